"""What a pack is, before any byte of one is read: the format's names and versions, the span a
block is (format), the typed header (header), the block table (table), and how a span is laid out
for storage (stored). It imports nothing else of the pack: every other room builds on it."""
