"""Question sets for `mmkv eval`: the item record and its scoring (items.py), and one reader per
annotation format (readers.py): mmkv's JSONL, MLVU/ReKV, Video-MME, EgoSchema, OVO-Bench and
MMLongBench-Doc. The media come from the user; nothing here downloads."""
