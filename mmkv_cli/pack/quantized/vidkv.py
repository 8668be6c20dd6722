"""1.5-bit KV after VidKV (Tao et al., arXiv 2503.16257; code KD-TAO/VidKV), as pure functions.

Keys, in each key group (a layer's `group` tokens, spanning blocks as every v9 key group does): the
half of the head-dim channels with the widest range over the group's tokens and heads (VidKV's
"difficult" channels) get 2 bits, asymmetric, a float16 scale and zero per head and channel; the
other half get 1 bit in the frequency domain: per token and head, the real FFT of those D/2 values
is D/2 real numbers, each stored as its sign against a scale per head and component (the mean of
its magnitude over the group). That is 1.5 bits a key value. A key group is stored as [3, H, D]
float16: plane 0 the scales (the easy channels' slots hold the component scales, in channel
order), plane 1 the zeros (0 at easy slots), plane 2 one where the channel is 2-bit.

Values, per channel over the same groups of tokens (VidKV's 1.58 bits, per channel as its code's
axis_value -1 and its paper ask): q in {-1, 0, 1} by a threshold of half the channel's mean
magnitude over the group, decoded q x that mean; five such trits a byte (1.6 bits a value). The
mean is the key group's fourth plane.
"""

from __future__ import annotations

import functools

from mmkv_cli.core.lazy import torch
from mmkv_cli.pack.quantized.codes import pack_codes

TRITS_PER_BYTE = 5


def key_width(dim: int) -> int:
    """Bytes of one head's key codes: D/2 channels at 2 bits, then D/2 signs at 1 bit (a head
    dimension of 8 rounds its 4 signs up to a byte)."""
    return dim // 8 + -(-dim // 16)


def value_width(dim: int) -> int:
    """Bytes of one head's value codes: five trits a byte."""
    return -(-dim // TRITS_PER_BYTE)


def real_components(x: torch.Tensor) -> torch.Tensor:
    """[..., E] real (E even) -> [..., E] its real FFT as E real numbers: the real parts of bins
    0..E/2 and the imaginary parts of bins 1..E/2-1 (those of bins 0 and E/2 are 0)."""
    spectrum = torch.fft.rfft(x.float(), dim=-1)
    half = x.shape[-1] // 2
    return torch.cat([spectrum.real, spectrum.imag[..., 1:half]], dim=-1)


def from_components(c: torch.Tensor) -> torch.Tensor:
    """The inverse of real_components."""
    size = c.shape[-1]
    half = size // 2
    zero = c.new_zeros(*c.shape[:-1], 1)
    imag = torch.cat([zero, c[..., half + 1 :], zero], dim=-1)
    return torch.fft.irfft(torch.complex(c[..., : half + 1], imag), n=size, dim=-1)


def group_planes(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One group's keys and values [n, H, D] -> its stored planes [4, H, D] float16 (module
    docstring). The 2-bit channels are the D/2 with the widest range over all heads and tokens, as
    VidKV's dynamic_quantize_key picks them (ties to the lower channel)."""
    x = keys.float()
    _, heads, dim = x.shape
    spread = x.amax(dim=(0, 1)) - x.amin(dim=(0, 1))
    hard = torch.zeros(dim, dtype=torch.bool)
    hard[torch.argsort(-spread, stable=True)[: dim // 2]] = True
    low, high = x[:, :, hard].amin(dim=0), x[:, :, hard].amax(dim=0)
    planes = torch.zeros(4, heads, dim)
    planes[0][:, hard] = (high - low) / 3
    planes[1][:, hard] = low
    planes[0][:, ~hard] = real_components(x[:, :, ~hard]).abs().mean(dim=0)
    planes[2][:, hard] = 1.0
    planes[3] = values.float().abs().mean(dim=0)
    return planes.to(torch.float16)


def two_bit_flags_sound(flags: torch.Tensor) -> bool:
    """flags [G, H, D] (plane 2 of stored groups): every one 0 or 1, half of each head's 1."""
    ones = flags == 1
    return bool(((flags == 0) | ones).all()) and bool(
        (ones.sum(dim=-1) == flags.shape[-1] // 2).all()
    )


def _order(planes: torch.Tensor) -> torch.Tensor:
    """[n, H, D] channel indices: each token's 2-bit channels ascending, then its 1-bit ones."""
    easy = (planes[:, 2] < 0.5).to(torch.int8)
    return torch.argsort(easy, dim=-1, stable=True)


def encode_keys(keys: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """Keys [n, H, D] and each token's group planes [n, 3, H, D] -> codes [n, H, 3D/16] uint8:
    the 2-bit channels' codes (2 bits each, lowest first), then the easy part's FFT signs."""
    planes = planes.float()
    order = _order(planes)
    half = keys.shape[-1] // 2
    x = keys.float().gather(-1, order)
    scale, zero = planes[:, 0].gather(-1, order), planes[:, 1].gather(-1, order)
    safe = torch.where(scale[..., :half] > 0, scale[..., :half], torch.ones_like(scale[..., :half]))
    hard = ((x[..., :half] - zero[..., :half]) / safe).round_().clamp_(0, 3).to(torch.uint8)
    signs = (real_components(x[..., half:]) >= 0).to(torch.uint8)
    signs = torch.nn.functional.pad(signs, (0, -half % 8))  # whole bytes
    return torch.cat([pack_codes(hard, 2), pack_codes(signs, 1)], dim=-1)


def prepare(planes: torch.Tensor) -> tuple:
    """Key groups' planes [G, 4, H, D] -> what decoding needs of each, made once per group, not
    per token: (where each channel sits among [2-bit ones, easy ones], the 2-bit scales and zeros
    and the component scales in that order, the values' means, the inverse FFT as a matrix)."""
    planes = planes.float()
    order = _order(planes)
    scale, zero = planes[:, 0].gather(-1, order), planes[:, 1].gather(-1, order)
    half = planes.shape[-1] // 2
    # from_components is linear: its rows for the unit vectors make it one matrix product
    inverse = from_components(torch.eye(half, device=planes.device))
    return torch.argsort(order, dim=-1), scale, zero, planes[:, 3], inverse


def decode_keys(packed: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """The inverse of encode_keys, float32 [n, H, D] (planes: each token's group's)."""
    return decode_keys_at(packed, prepare(planes), torch.arange(packed.shape[0]))


def decode_keys_at(packed: torch.Tensor, prepared: tuple, rows: torch.Tensor) -> torch.Tensor:
    """Key codes [n, H, B] of groups rows [n] of `prepared` (prepare()) -> float32 [n, H, D]."""
    where, scale, zero, _, inverse = prepared
    where, scale, zero = (t.index_select(0, rows) for t in (where, scale, zero))
    n, heads, dim = scale.shape
    half = dim // 2
    levels, signs = _unpacking(str(packed.device))  # lookups, not shifts: five times as fast
    hard = levels.index_select(0, packed[..., : dim // 8].reshape(-1).long()).reshape(n, heads, -1)
    easy = signs.index_select(0, packed[..., dim // 8 :].reshape(-1).long())
    easy = easy.reshape(n, heads, -1)[..., :half]
    hard = hard * scale[..., :half] + zero[..., :half]
    easy = (easy * scale[..., half:]) @ inverse
    return torch.cat([hard, easy], dim=-1).gather(-1, where)


@functools.cache
def _unpacking(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([256, 4] a byte's four 2-bit codes, [256, 8] its eight bits as -1 / +1), lowest first."""
    byte = torch.arange(256)
    levels = torch.stack([(byte >> s) & 3 for s in range(0, 8, 2)], dim=-1).float()
    signs = torch.stack([(byte >> s) & 1 for s in range(8)], dim=-1).float() * 2 - 1
    return levels.to(device), signs.to(device)


def encode_values(values: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """Values [n, H, D] and each token's group planes [n, 4, H, D] -> codes [n, H, ceil(D/5)]
    uint8: q = sign(x) where |x| > half the channel's mean |x| over the group, else 0."""
    n, heads, dim = values.shape
    mean = planes[:, 3].float()
    x = values.float()
    trits = (x > mean / 2).to(torch.uint8) - (x < -mean / 2).to(torch.uint8) + 1
    pad = value_width(dim) * TRITS_PER_BYTE - dim
    trits = torch.nn.functional.pad(trits, (0, pad), value=1).reshape(n, heads, -1, TRITS_PER_BYTE)
    weights = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=values.device)
    return (trits * weights).sum(dim=-1, dtype=torch.uint8)


def decode_values(packed: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """The inverse of encode_values, float32 [n, H, D] (planes: each token's group's)."""
    return decode_values_with(packed, planes[:, 3].float())


def decode_values_with(packed: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Ternary value codes [n, H, ceil(D/5)] and each token's channel means [n, H, D]."""
    n, heads, dim = means.shape
    table = _trits(str(packed.device))  # a byte's five trits: a lookup, not five divisions
    q = table.index_select(0, packed.reshape(-1).long()).reshape(n, heads, -1)[..., :dim]
    return q * means


@functools.cache
def _trits(device: str) -> torch.Tensor:
    """[256, 5] the q of every byte's five trits (bytes past 242 read their digits mod 3)."""
    weights = (1, 3, 9, 27, 81)
    table = torch.stack([(torch.arange(256) // w) % 3 for w in weights], dim=-1).float() - 1
    return table.to(device)
