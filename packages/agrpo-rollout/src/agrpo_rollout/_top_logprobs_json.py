"""The `top_logprobs` array of a `/v1/completions` response, decoded from its bytes in bulk.

Owns the byte layout `[{"token_id:ID":VALUE,...},...]` (vLLM's `return_tokens_as_token_ids`, written
by `json.dumps` with compact separators) and its conversion to arrays without one Python object per
token. Does not know the response envelope, `token_ids`, or HTTP (`_completion_response.py`).

How (about 1.2 of the 1.4 us per generated token with 9 entries, `tools/bench/rollout_client`):
1. one numpy scan finds every `:` and `.`; from the colons follow every entry's key, value and row
   bounds, and every byte of the array is checked against that layout;
2. two unaligned gathers per entry fetch its id (left-aligned, 8 bytes) and the last 24 bytes of
   its number (right-aligned; a number with an exponent is re-gathered at its `e`); a shift closes the
   gap of the decimal point, a table mask keeps the digits, and 8 ASCII digits per uint64 become an
   integer with three multiplications (SWAR);
3. a number is that integer divided by a power of ten: exactly Python's `float()` when both are exact
   doubles (< 2**53, <= 1e22); otherwise its float32 is kept only if it provably rounds like the
   reference (not within 2**-20 float32 ulps of a half-way point).
Anything else (text keys, `null` rows, whitespace, NaN, a positive exponent, a number longer than 24
characters) returns None, and the caller takes the plain `json.loads` path.
"""

from __future__ import annotations

import numpy as np

_WIDTH = 24  # bytes gathered per number: Python's repr of a float is at most 24 characters


def _u64(value: int) -> np.ndarray:
    return np.array(value, dtype=np.uint64)  # 0-d: the cheapest operand for numpy's binary ops


def _byte_masks(keep: np.ndarray) -> np.ndarray:
    """(rows, 32) bool -> one 32-byte item per row (0xFF where kept) for single-gather lookups."""
    return np.where(keep, 255, 0).astype(np.uint8).reshape(-1, 32).view("V32")[:, 0]


_ZEROS = _u64(0x3030303030303030)  # eight ASCII `0`
_SWAR = [  # (mask, multiplier, shift): 8 ASCII digits in a little-endian uint64 -> their value
    (_u64(0x0F0F0F0F0F0F0F0F), _u64(2561), _u64(8)),
    (_u64(0x00FF00FF00FF00FF), _u64(6553601), _u64(16)),
    (_u64(0x0000FFFF0000FFFF), _u64(42949672960001), _u64(32)),
]
_KEY_TAIL = _u64(int.from_bytes(b"oken_id:", "little"))
_KEY_HEAD = _u64(int.from_bytes(b'"t', "little"))
_SHIFT_TOP, _SHIFT_BYTE = _u64(48), _u64(8)
_CARRY = _u64(56)
_E_MARK = (_u64(0x2020202020202020), _u64(int.from_bytes(b"e" * 8, "little")), _u64(0x7F7F7F7F7F7F7F7F))
_EXPONENT_NEED, _EXPONENT_WEIGHTS = np.array([0, 1, 2]), np.array([100, 10, 1])  # last 3 bytes
_E16, _E8 = _u64(10**16), _u64(10**8)
_POW10_INT = np.array([10**k for k in range(9)], dtype=np.uint64)
_POW10 = np.array([float(f"1e{k}") for k in range(401)])  # correctly rounded; exact up to 1e22


def _mask_tables() -> tuple[np.ndarray, np.ndarray]:
    """An entry's words: [id digits left-aligned, the number's 24 bytes right-aligned]. KEEP[9 * n + i]
    keeps the id's first i bytes and the number's last n; LEFT[c] marks the number's columns < c."""
    column, id_bytes, counts = np.arange(32), np.arange(9)[None, :, None], np.arange(_WIDTH + 1)
    number = column >= 8
    keep = (column < id_bytes) | (number & (column >= 32 - counts[:, None, None]))
    return _byte_masks(keep), _byte_masks(number & (column < 8 + counts[:, None]))


_KEEP, _LEFT = _mask_tables()


def _rows(raw: bytes, first: np.ndarray, width: int) -> np.ndarray:
    """(N, width // 8) uint64: the `width` bytes of `raw` from each `first` on (one unaligned gather)."""
    view = np.ndarray((len(raw) - width + 1,), f"V{width}", raw, 0, (1,))
    return view[first].view("<u8").reshape(-1, width // 8)


def _entry_layout(raw: bytes, scan: np.ndarray, lo: int, hi: int):
    """(key colons, value colons, dots or 0, value ends, row-first entries) of `raw[lo:hi + 1]`, which
    must read `[{"token_id:ID":VALUE,...},{...}]`; None otherwise. Ids and values are checked later."""
    region = scan[lo:hi]
    found = ((region == 58) | (region == 46)).nonzero()[0]  # `:` and `.`
    found += lo
    kind = scan[found]
    if found.size % 3 == 0 and (kind[2::3] == 46).all() and (kind[0::3] == 58).all():
        key_colon, value_colon, dots = found[0::3], found[1::3], found[2::3]
    else:  # some number without a decimal point
        colons, dots_only = found[kind == 58], found[kind == 46]
        key_colon, value_colon = colons[0::2], colons[1::2]
        dots = np.zeros(value_colon.shape[0], np.int64)
        owner = np.searchsorted(value_colon, dots_only) - 1
        if colons.size % 2 or (owner.size and (owner.min() < 0 or (np.diff(owner) < 1).any())):
            return None
        dots[owner] = dots_only
    num = key_colon.shape[0]
    if num == 0 or value_colon.shape[0] != num or key_colon[0] != lo + 11 or scan[hi - 1] != 125:
        return None
    separator = scan[key_colon - 10]
    row_first = separator == 123  # `{`; otherwise `,`
    ends = np.empty(num, np.int64)
    ends[:-1] = key_colon[1:] - 10
    ends[:-1] -= row_first[1:] * 2  # `},{` instead of `,`
    ends[-1] = hi - 1
    starts = row_first.nonzero()[0]
    row_last = ends[starts[1:] - 1]
    bad = scan[value_colon - 1] != 34
    bad |= (separator != 44) & ~row_first
    if bad.any() or (scan[row_last] != 125).any() or (scan[row_last + 1] != 44).any():
        return None
    return key_colon, value_colon, dots, ends, starts


def _exponents(raw: bytes, words: np.ndarray, ends: np.ndarray):
    """(exponent, mantissa end) per number; re-gathers the numbers with an exponent, which must be
    Python's form: `e`, a sign and 1 to 3 digits, in the number's last 8 bytes (no key's `e` is)."""
    exponent = np.zeros(words.shape[0], np.int64)
    case, letter, low7 = _E_MARK
    marked = (words[:, 3] | case) ^ letter  # zero bytes at `e` and `E`
    which = (~(((marked & low7) + low7) | marked | low7)).nonzero()[0]  # exact zero-byte test
    if not which.size:
        return exponent, ends
    tail = words[which, 3].view(np.uint8).reshape(-1, 8)  # the number's last 8 bytes
    column = ((tail | np.uint8(32)) == 101).argmax(1)  # of its `e`, then a sign, then digits
    digits = tail[:, 5:] - np.uint8(48)
    used = (column - 3)[:, None] <= _EXPONENT_NEED  # digit columns 5, 6, 7 after the sign
    sign = tail.reshape(-1)[np.arange(0, tail.size, 8) + np.minimum(column + 1, 7)]
    if column.min() < 3 or column.max() > 5:  # 1 to 3 digits
        return None
    if not (((digits < 10) | ~used).all() and ((sign == 45) | (sign == 43)).all()):
        return None
    exponent[which] = ((digits * used) @ _EXPONENT_WEIGHTS) * (44 - sign.astype(np.int64))
    ends = ends.copy()
    ends[which] += column - 8
    words[which] = _rows(raw, ends[which] - 32, 32)
    return exponent, ends


def _rounds_like_python(value: np.ndarray) -> bool:
    """Whether float32(value) equals float32(float(text)) although `value` may be off by a few
    float64 ulps: true unless it lies within 2**-20 float32 ulps of a float32 half-way point."""
    single = value.astype(np.float32)
    back = single.astype(np.float64)
    toward = np.where(value > back, np.float32(np.inf), np.float32(-np.inf))
    ulp = np.abs(np.nextafter(single, toward).astype(np.float64) - back)
    return bool((np.abs(value - back) < ulp * (0.5 - 2.0**-20)).all())


def _entries(raw: bytes, scan: np.ndarray, layout) -> tuple[np.ndarray, np.ndarray] | None:
    """(int64 id, float32 number) of each entry, checking the key bytes and every character."""
    key_colon, value_colon, dots, ends, _ = layout
    key = _rows(raw, key_colon - 15, 24)  # `...,"token_id:`, then the id left-aligned
    words = _rows(raw, ends - 32, 32)  # the number right-aligned in the last 24 bytes
    parsed = _exponents(raw, words, ends)
    if parsed is None:
        return None
    words[:, 0] = key[:, 2]
    exponent, ends = parsed
    id_length = value_colon - key_colon - 2
    negative = scan[value_colon + 1] == 45
    has_dot = dots > 0
    num_digits = ends - value_colon - 1 - negative - has_dot
    dot_column = np.where(has_dot, dots - ends + _WIDTH, -1)
    bad = (key[:, 1] != _KEY_TAIL) | ((key[:, 0] >> _SHIFT_TOP) != _KEY_HEAD)
    bad |= has_dot & ((dots <= value_colon + 1 + negative) | (dots >= ends - 1))
    if (
        bad.any()
        or min(id_length.min(), num_digits.min()) < 1
        or id_length.max() > 8
        or num_digits.max() > _WIDTH
    ):
        return None
    flat = words.reshape(-1)
    shifted = flat << _SHIFT_BYTE  # every byte one column right: closes the gap of the dot
    shifted[1:] |= flat[:-1] >> _CARRY
    words ^= (words ^ shifted.reshape(words.shape)) & _LEFT[dot_column + 1].view("<u8").reshape(-1, 4)
    words = _ZEROS ^ ((words ^ _ZEROS) & _KEEP[num_digits * 9 + id_length].view("<u8").reshape(-1, 4))
    if not ((words.view(np.uint8) - np.uint8(48)) < 10).all():
        return None
    words &= _SWAR[0][0]
    for step, (mask, multiplier, shift) in enumerate(_SWAR):  # in place: no temporaries
        if step:
            words &= mask
        words *= multiplier
        words >>= shift
    if words[:, 1].max() >= 1800:  # more than 19 digits
        return None
    mantissa = words[:, 1] * _E16 + words[:, 2] * _E8 + words[:, 3]
    scale = np.where(has_dot, _WIDTH - 1 - dot_column, 0) - exponent
    if scale.min() < 0:
        return None
    value = mantissa.astype(np.float64) / _POW10[np.minimum(scale, 400)]
    np.negative(value, out=value, where=negative)
    if mantissa.max() >= 2**53 or scale.max() > 22:  # not both exact doubles: check the rounding
        inexact = (mantissa >= 2**53) | (scale > 22)
        if not _rounds_like_python(value[inexact]):
            return None
    return (words[:, 0] // _POW10_INT[8 - id_length]).astype(np.int64), value.astype(np.float32)


def _top_rows(ids: np.ndarray, values: np.ndarray, starts: np.ndarray, num_top: int):
    """(T, K) ids and log-probs from the entries, dropping a row's first entry when it has K+1."""
    num, rows = ids.shape[0], starts.shape[0]
    counts = np.empty(rows, np.int64)
    counts[:-1] = starts[1:] - starts[:-1]
    counts[-1] = num - starts[-1]
    if counts.max() > num_top + 1:
        return None
    dropped = counts > num_top
    if counts.min() >= num_top:  # vLLM's rows: K+1 (sampled outside the top K) or K entries
        keep = np.ones(num, bool)
        keep[starts[dropped]] = False
        return ids[keep].reshape(rows, num_top), values[keep].reshape(rows, num_top)
    index = np.minimum((starts + dropped)[:, None] + np.arange(num_top), num - 1)
    valid = np.arange(num_top) < (counts - dropped)[:, None]
    return np.where(valid, ids[index], -1), np.where(valid, values[index], np.float32(-np.inf))


def decode_top_logprobs(raw: bytes, lo: int, hi: int, num_top: int):
    """Decode `raw[lo:hi + 1]`, a `top_logprobs` array (T rows), into (first id of each row (T,),
    first log-prob of each row (T,), ids (T, K) padded with -1, float32 log-probs (T, K) padded with
    -inf); a row of K+1 entries drops its first. None when the bytes are not in the expected layout."""
    if len(raw) - hi < 32:  # room for the last gathers
        raw = raw + b" " * 32
    scan = np.frombuffer(raw, np.uint8)
    layout = _entry_layout(raw, scan, lo, hi)
    entries = None if layout is None else _entries(raw, scan, layout)
    top = None if entries is None else _top_rows(*entries, layout[4], num_top)
    if top is None:
        return None
    starts = layout[4]
    return entries[0][starts], entries[1][starts], *top
