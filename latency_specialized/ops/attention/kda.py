"""(being written)"""
IMPLEMENTATIONS: list = []
