"""specheads.configs"""

if __name__ != "specheads.configs":
    raise ImportError(
        f"this folder is the package 'specheads.configs' and cannot be imported as {__name__!r}; "
        "install specheads (pip install -e .) and use `import specheads.configs`"
    )
