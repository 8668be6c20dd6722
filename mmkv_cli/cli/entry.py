"""The `mmkv` console entry: `--version` answered before the CLI's modules load (a script checking
the version, or a client's start-up, pays for Python alone); everything else goes to the app."""

import sys


def main() -> None:
    if sys.argv[1:] in (["--version"], ["-V"]):
        from mmkv_cli import __version__

        sys.stdout.write(f"mmkv {__version__}\n")
        return
    from mmkv_cli.cli.app import main as app_main

    app_main()
