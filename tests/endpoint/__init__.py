

def audit_parser():
    """The `verispec audit` command's own parser (both modes' options), as a test parses it."""
    import argparse

    from verispec.cli.audit import add_audit_parser
    sub = argparse.ArgumentParser(prog="verispec").add_subparsers()
    add_audit_parser(sub)
    return sub.choices["audit"]
