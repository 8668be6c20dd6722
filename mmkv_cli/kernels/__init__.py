"""The numeric kernels the stages share: attention scores recorded without eager maps (attention,
fused_attention, recorder) and RoPE re-rotation of stored keys (rope)."""
