"""Training text every Python install has: the bytes of the standard library's source files.

    [stdlib *.py, sorted] -> one uint8 tensor -> random windows (seeded) -> (inputs [B, T], targets [B, T])

Shapes: B sequences per batch, T bytes per sequence (the vocabulary is the 256 byte values).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4 << 20  # 4 MiB: ~ 250 files, far more text than a few minutes of training reads


@dataclass(frozen=True)
class ByteCorpus:
    """The training text and where it came from."""

    data: torch.Tensor  # [L] uint8; the files' bytes back to back, in sorted path order
    root: str  # the stdlib directory read
    files: int  # files read (a prefix of the sorted list, up to max_bytes)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """B random windows: inputs [B, T] int64 and the next-byte targets [B, T] int64."""
        if self.data.numel() < seq_len + 2:
            raise ValueError(f"seq_len={seq_len} needs more than the corpus's {self.data.numel()} bytes")
        starts = torch.randint(0, self.data.numel() - seq_len - 1, (batch_size,), generator=generator)  # [B]
        window = starts[:, None] + torch.arange(seq_len + 1)  # [B, T+1]
        tokens = self.data[window].long()  # [B, T+1]
        return tokens[:, :-1], tokens[:, 1:]


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's *.py files in sorted path order (the same order on every run), leaving
    out site-packages and the test suites (large generated data, not code)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    return sorted(p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts))


def load_stdlib_bytes(max_bytes: int = DEFAULT_MAX_BYTES, root: str | Path | None = None) -> ByteCorpus:
    """Read stdlib files in sorted order until ``max_bytes`` (the last file cut there)."""
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    chunks, total, files = [], 0, 0
    for path in stdlib_files(base):
        if total >= max_bytes:
            break
        text = path.read_bytes()[: max_bytes - total]
        chunks.append(text)
        total += len(text)
        files += 1
    if not total:
        raise ValueError(f"no Python source found under {base}")
    data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # [L]
    return ByteCorpus(data=data, root=str(base), files=files)
