from mmkv_cli.cli import main

main()
