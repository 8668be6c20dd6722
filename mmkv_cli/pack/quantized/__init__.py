"""KV stored in fewer bits: the group quantizer and its specs (quant), whether stored scales
decode finite (decodable), VidKV's 1.5- and 2-bit codes (vidkv) and the bit packing they share
(codes). It imports the schema, io and integrity
rooms only."""
