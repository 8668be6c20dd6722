from mmkv_cli.cli.app import main

main()
