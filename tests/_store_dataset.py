"""A torch Dataset over a read-only store, opened lazily in each DataLoader worker.

It lives in its own module so that ``spawn`` workers can import it by name.
"""

from __future__ import annotations

import os

import torch

import tiered


class StoreDataset(torch.utils.data.Dataset):
    """Rows of a store; the store is opened read-only on first use in each process."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n
        self._store = None
        self._pid = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self._store is None or self._pid != os.getpid():
            self._store = tiered.open(self.path, mode="r", warm_bytes=0)
            self._pid = os.getpid()
        td = self._store.get(int(i))
        return {"observation": td["observation"], "action": td["action"], "pid": torch.tensor(os.getpid())}

    def __getstate__(self):
        return {"path": self.path, "n": self.n}

    def __setstate__(self, state):
        self.__init__(state["path"], state["n"])
