"""github"""
