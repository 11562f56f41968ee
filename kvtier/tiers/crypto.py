"""AES-256-GCM for NVMe record payloads (opt-in: `nvme.encryption_key_file`).

The key file holds the 256-bit key as 64 hex digits (what `kvtier keygen` and `openssl
rand -hex 32` write; surrounding whitespace is ignored) and must give group and others no
access at all (mode 0600 or 0400): anything else is refused at start. Hex only: a raw
binary format would also accept 32 typed characters, a far weaker key, without a word.

Each record is sealed under its own AES-256 key, derived from the file's key and a random
128-bit salt with keyed BLAKE2b, and a random 96-bit nonce; salt, nonce, tag and an
8-byte key id sit in the record header (`Seal`). A fresh key per record means no (key,
nonce) pair can repeat however many records are written and however often generations
restart, so there is no 2^32-records-per-key budget to track. The same derivation yields
a 64-bit mask for the payload's xxh3 stored in the header, so the plaintext checksum (a
way to confirm a guess of a block's content) is not readable on disk either.

The caller passes the associated data: the whole header before the tag, i.e. namespace
id, key, generation, lengths, codec, flags, salt and nonce. A record moved to another
key's path, relabelled with another generation, cut, or sealed under another key fails
`decrypt` with CorruptRecord.

The streaming GCM interface is used (not `AESGCM.encrypt`) because the tag lives in the
header, apart from the ciphertext, and because it writes straight into the caller's
buffers. `update_into` releases the GIL (measured: another thread ran on, stalled at most
3 ms, through a 165 ms call), so I/O threads encrypt in parallel with the event loop.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.errors import ConfigError, CorruptRecord

KEY_BYTES = 32
KEY_ID_BYTES = 8
SALT_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL = struct.Struct(f"<{KEY_ID_BYTES}s{SALT_BYTES}s{NONCE_BYTES}s{TAG_BYTES}s")
_MAX_KEY_FILE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Seal:
    """What opening a sealed record needs besides the key, as stored in its header."""

    key_id: bytes
    salt: bytes
    nonce: bytes
    tag: bytes

    def pack(self) -> bytes:
        return SEAL.pack(self.key_id, self.salt, self.nonce, self.tag)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> Seal:
        return cls(*SEAL.unpack(data))


def load_key_file(path: Path, setting: str = "nvme.encryption_key_file") -> bytes:
    """The 32-byte key in `path`; ConfigError says what is wrong (naming `setting`) and
    how to fix it."""
    where = f"{setting}: {path}"
    try:
        # O_NONBLOCK: a FIFO in its place opens at once (and is refused below) instead of
        # hanging the start. A link is followed: the path is the operator's (e.g. a
        # systemd credential), not a file in the tier.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist (make one: kvtier keygen {path})") from None
    except OSError as err:
        raise ConfigError(
            f"{where}: cannot read it ({err.strerror}); it must belong to the service user"
        ) from None
    try:
        # fstat, not stat: judge the file that was opened, not whatever the name points to now.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{where} is not a regular file")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"{where} is accessible to group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); run: chmod 600 {path}"
            )
        data = os.read(fd, _MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return parse_key(data, where)


def parse_key(data: bytes, where: str = "key") -> bytes:
    """The key in a key file's bytes: 64 hex digits, surrounding whitespace ignored."""
    text = data.strip()
    key: bytes | None = None
    if len(text) == 2 * KEY_BYTES:
        try:
            key = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            key = None
    if key is None:
        raise ConfigError(
            f"{where} must hold 64 hex digits (a 256-bit key, as kvtier keygen or "
            f"openssl rand -hex 32 write it); it holds {len(data)} bytes that are not that"
        )
    if key == bytes(KEY_BYTES):
        raise ConfigError(f"{where} is all zeros: make a real key with kvtier keygen")
    return key


def write_key_file(path: Path) -> None:
    """A new random key in `path` (64 hex digits, mode 0600); refuses to replace a file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} exists: kvtier keygen never replaces a key (every record sealed with "
            "it would become unreadable); remove it first if that is what you want"
        ) from None
    except OSError as err:
        raise ConfigError(f"cannot create {path}: {err.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        line = (os.urandom(KEY_BYTES).hex() + "\n").encode()
        if os.write(fd, line) != len(line):
            raise ConfigError(f"short write to {path}")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


class RecordCipher:
    """Seals and opens record payloads with one key; thread-safe (no mutable state)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"an AES-256 key is {KEY_BYTES} bytes, not {len(key)}")
        self._key = key
        # Names the key in every record without revealing it: recovery drops records of
        # another key from the header alone, without reading their payloads.
        self.key_id = hashlib.blake2b(
            b"", key=key, person=b"kvtier-key-id", digest_size=KEY_ID_BYTES
        ).digest()

    @classmethod
    def from_key_file(cls, path: Path) -> RecordCipher:
        return cls(load_key_file(path))

    def new_seal(self) -> Seal:
        """Fresh random salt and nonce for one record; the tag is filled in by `encrypt`."""
        return Seal(self.key_id, os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES), b"")

    def _derive(self, salt: bytes) -> tuple[bytes, int]:
        """(this record's AES key, its xxh3 mask)."""
        out = hashlib.blake2b(salt, key=self._key, person=b"kvtier-record", digest_size=40)
        digest = out.digest()
        return digest[:KEY_BYTES], int.from_bytes(digest[KEY_BYTES:], "little")

    def xxh3_mask(self, seal: Seal) -> int:
        """XORed onto the payload's xxh3 in the header of a record sealed with `seal`."""
        return self._derive(seal.salt)[1]

    def encrypt(self, seal: Seal, aad: bytes, src: Sequence[memoryview], dst: memoryview) -> bytes:
        """Encrypt the concatenation of `src` into `dst` (as long as it); returns the tag."""
        key, _ = self._derive(seal.salt)
        ctx = Cipher(algorithms.AES(key), modes.GCM(seal.nonce)).encryptor()
        ctx.authenticate_additional_data(aad)
        done = 0
        for part in src:
            if len(part):
                done += ctx.update_into(part, dst[done : done + len(part)])
        if done != len(dst):
            raise ValueError(f"encrypted {done} bytes into a {len(dst)}-byte destination")
        ctx.finalize()
        return ctx.tag

    def decrypt(self, seal: Seal, aad: bytes, src: memoryview, dst: memoryview) -> None:
        """Decrypt `src` into `dst` (same length) and check the tag: CorruptRecord if the
        key, the associated data or any byte differ, with `dst` zeroed (the decryption
        writes unauthenticated plaintext before the tag can be checked)."""
        if seal.key_id != self.key_id:
            raise CorruptRecord("record is encrypted with another key")
        key, _ = self._derive(seal.salt)
        ctx = Cipher(algorithms.AES(key), modes.GCM(seal.nonce, seal.tag)).decryptor()
        ctx.authenticate_additional_data(aad)
        try:
            if len(src):
                ctx.update_into(src, dst)
            ctx.finalize()
        except InvalidTag:
            dst[:] = bytes(len(dst))
            raise CorruptRecord("payload failed authentication (AES-GCM tag)") from None
