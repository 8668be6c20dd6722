"""The writers and readers built on the rooms below: a pack written atomically (writer,
block_writing), while encoding (early), converted (convert), held in memory (memory), opened and
read lazily with every byte verified (opening, reader, block_store, side_tensors), and described
(report). The rest of the project reaches these through `mmkv_cli.pack`."""
