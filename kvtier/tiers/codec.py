"""Lossless payload codec for slow paths: byte-shuffle (group the i-th byte of every
element together) then lz4, and the measurement that decides whether it pays.

fp16/bf16 KV barely compresses as it is (plain lz4: ~1.00x here): each element's low byte
is noise. Its high bytes (sign, exponent) are not, and shuffled together they give lz4 runs
to find (~1.18x on bf16 activations here). Whether that is worth its CPU time depends on
the path: a read gains when sending fewer bytes saves more than decoding costs,

    1 / (ratio * B) + 1 / decode_speed  <  1 / B        (seconds per payload byte)

i.e. only below a bandwidth B that this machine's codec speed sets (see `CodecMeter`).
numpy does the shuffle (a strided copy in C; a memoryview slice copies at ~0.07 GB/s),
imported only when the codec is used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import lz4.block

from kvtier.errors import CorruptRecord

Buffer = bytes | bytearray | memoryview

CODEC_NONE = 0
CODEC_SHUFFLE_LZ4 = 1
CODEC_NAMES = {CODEC_NONE: "none", CODEC_SHUFFLE_LZ4: "shuffle+lz4"}


def encode(payload: Buffer, element_bytes: int) -> bytes:
    """Shuffle then compress `payload` (its length need not be a multiple of the element:
    the tail is left as it is)."""
    import numpy as np

    raw = np.frombuffer(payload, dtype=np.uint8)
    whole = len(raw) - len(raw) % element_bytes
    shuffled = raw[:whole].reshape(-1, element_bytes).T.tobytes() + raw[whole:].tobytes()
    return bytes(lz4.block.compress(shuffled, store_size=False))


def decode(blob: Buffer, element_bytes: int, payload_bytes: int, out: memoryview) -> None:
    """Undo `encode` into `out` (`payload_bytes` long); CorruptRecord if `blob` is not an
    encoding of exactly that many bytes."""
    import numpy as np

    if len(out) != payload_bytes:
        raise ValueError("output does not match the payload size")
    try:
        shuffled = lz4.block.decompress(blob, uncompressed_size=payload_bytes)
    except lz4.block.LZ4BlockError as err:
        raise CorruptRecord(f"compressed payload does not decode: {err}") from None
    if len(shuffled) != payload_bytes:
        raise CorruptRecord("compressed payload decodes to the wrong length")
    whole = payload_bytes - payload_bytes % element_bytes
    dest = np.frombuffer(out, dtype=np.uint8)
    src = np.frombuffer(shuffled, dtype=np.uint8)
    # One strided copy per byte plane: ~2.3 GB/s here, where assigning the transposed
    # (planes, elements) view in one go walks both arrays with strides at ~0.2 GB/s.
    elements = whole // element_bytes
    planes = dest[:whole].reshape(-1, element_bytes)
    for i in range(element_bytes):
        planes[:, i] = src[i * elements : (i + 1) * elements]
    dest[whole:] = src[whole:]


@dataclass(slots=True)
class CodecFigures:
    ratio: float  # raw bytes / encoded bytes
    encode_bytes_per_s: float
    decode_bytes_per_s: float
    samples: int


class CodecMeter:
    """Running estimates of the codec's ratio and speeds on the blocks actually stored.

    Fed by every encode/decode while the codec is in use, and by a trial on one write in
    `trial_every` while it is not (so a change in the data, or in the path, turns it back
    on). Exponentially weighted: recent blocks count most."""

    def __init__(self, trial_every: int = 32, weight: float = 0.2) -> None:
        self.trial_every = trial_every
        self.weight = weight
        self._figures: CodecFigures | None = None
        self._writes = 0

    @property
    def figures(self) -> CodecFigures | None:
        return self._figures

    def observe(self, raw_bytes: int, encoded_bytes: int, encode_s: float, decode_s: float) -> None:
        if raw_bytes <= 0 or encoded_bytes <= 0 or encode_s <= 0 or decode_s <= 0:
            return
        ratio = raw_bytes / encoded_bytes
        enc, dec = raw_bytes / encode_s, raw_bytes / decode_s
        old = self._figures
        if old is None:
            self._figures = CodecFigures(ratio, enc, dec, 1)
            return
        w = self.weight
        self._figures = CodecFigures(
            (1 - w) * old.ratio + w * ratio,
            (1 - w) * old.encode_bytes_per_s + w * enc,
            (1 - w) * old.decode_bytes_per_s + w * dec,
            old.samples + 1,
        )

    def observe_decode(self, raw_bytes: int, decode_s: float) -> None:
        old = self._figures
        if old is None or raw_bytes <= 0 or decode_s <= 0:
            return
        w = self.weight
        old.decode_bytes_per_s = (1 - w) * old.decode_bytes_per_s + w * raw_bytes / decode_s

    def due_for_trial(self) -> bool:
        """Whether this write (the codec off) should measure it anyway."""
        self._writes += 1
        return self._figures is None or self._writes % self.trial_every == 0

    def worth_it(self, bandwidth_bytes_per_s: float) -> bool:
        """Whether a read over a path of this bandwidth is faster encoded (see the module)."""
        fig = self._figures
        if fig is None or bandwidth_bytes_per_s <= 0:
            return False
        encoded = 1 / (fig.ratio * bandwidth_bytes_per_s) + 1 / fig.decode_bytes_per_s
        return encoded < 1 / bandwidth_bytes_per_s

    def break_even_bytes_per_s(self) -> float:
        """The path bandwidth below which the codec pays (0: never, or not measured)."""
        fig = self._figures
        if fig is None or fig.ratio <= 1:
            return 0.0
        return fig.decode_bytes_per_s * (1 - 1 / fig.ratio)


def trial(payload: Buffer, element_bytes: int) -> tuple[bytes, float, float]:
    """Encode and decode `payload` once: (encoded, encode seconds, decode seconds)."""
    started_s = time.perf_counter()
    blob = encode(payload, element_bytes)
    encoded_s = time.perf_counter() - started_s
    out = bytearray(len(memoryview(payload)))
    started_s = time.perf_counter()
    decode(blob, element_bytes, len(out), memoryview(out))
    return blob, encoded_s, time.perf_counter() - started_s
