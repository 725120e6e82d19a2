"""`verispec models`: list and pull the offline model presets."""

from __future__ import annotations

from .common import UsageError


def cmd_models(args) -> int:
    from ..models.loading import pull_preset
    from ..models.presets import PRESETS, preset_status

    if args.models_cmd == "list":
        from rich.console import Console
        from rich.table import Table
        t = Table(title="verispec model presets")
        for col in ("name", "architecture", "installed", "converted", "size", "sha256"):
            t.add_column(col)
        for name, preset in PRESETS.items():
            st = preset_status(name)
            size = st.get("size_bytes")
            t.add_row(name, getattr(preset, "architecture", ""), "yes" if st["installed"] else "no",
                      "yes" if st["converted"] else "no",
                      f"{size / 1e6:.0f} MB" if size else "-", (st.get("sha256") or "")[:16] + "...")
        Console().print(t)
        return 0
    if args.models_cmd == "pull":
        for name in args.names:
            if name not in PRESETS:
                raise UsageError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
            path = pull_preset(name)
            print(f"{name}: ready at {path}")
        return 0
    raise UsageError("usage: verispec models {list,pull}")


def add_models_parser(sub) -> None:
    m = sub.add_parser("models", help="list or pull the offline model presets")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="show presets: installed, converted, size, checksum")
    pull = msub.add_parser("pull", help="install, assemble, verify and convert presets")
    pull.add_argument("names", nargs="+")
    m.set_defaults(func=cmd_models)
