"""The two rich consoles every command prints through (stdout for answers, stderr for progress and errors)."""
from rich.console import Console

console = Console(stderr=False, highlight=False)
err_console = Console(stderr=True, highlight=False)
