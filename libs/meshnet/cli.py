"""Placeholder entry point, replaced by the full CLI."""
def main() -> None:
    raise SystemExit("meshnet CLI not built yet")
