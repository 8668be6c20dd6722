"""Bytes on and off the disk, whatever they mean: atomic replacement of a file (atomic), local and
remote files behind one interface (storage, source), vectored reads (vectored, libc), pinned host
staging (staging), write-behind (writeback) and the thread pools they share (pools). It knows no
pack format: it imports nothing of the pack."""
