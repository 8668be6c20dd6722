"""What makes an untrusted file a pack mmkv may use: the safetensors directory and the header
checked (checks), the tensors read through a checked directory (tensors) and their shapes against
the header (shapes), the digests over every byte (hashing, read_units), and the verdicts on
non-finite values (finite, verdicts). It imports the schema and io rooms only."""
