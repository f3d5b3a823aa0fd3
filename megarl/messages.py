"""User-facing error messages are one line (STYLE.md): flattening what goes into them."""


def one_line(value: object) -> str:
    """`str(value)` with every run of whitespace, newlines included, collapsed to one space."""
    return " ".join(str(value).split())
