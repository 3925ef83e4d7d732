"""The durable store: everything that puts a store on disk and gets it back.

Modules:

* :mod:`~tiered.durable.store_files`: :class:`StoreFiles`, a store's directory: commits, opening,
  the consistency checks of an open, the cold segments it owns, readers' staleness checks.
* :mod:`~tiered.durable.manifest`: ``manifest.json`` (the commit record) and checked ``.npy`` files.
* :mod:`~tiered.durable.array_files`: one file per array, changed in place, and the before-images
  through which a crash, and a reader of an older commit, get the old bytes back.
* :mod:`~tiered.durable.checked_maps`: array files memory-mapped, each page checked at first use.
* :mod:`~tiered.durable.commit_arrays`: where a commit's arrays are, how its saved row tables expand.
* :mod:`~tiered.durable.lock`: the writer lock (one writer, any number of readers).
* :mod:`~tiered.durable.sharing`: several writer processes, the lock taken per call.
* :mod:`~tiered.durable.summary`: ``tiered info``'s figures from a manifest alone (no torch).

Every file write goes through :mod:`tiered.util.fileio` (the seam where tests inject faults);
it sits in :mod:`tiered.util` because the tiers below this package write through it too.

Design note (docs/format.md has the bytes):

* **What a commit writes, in order.** Commit ``g`` (1) appends the blobs of closed time chunks to
  the cold segments and fsyncs them; (2) writes to ``arrays/undo.<g>`` the current bytes of every
  range of an array file it will change in place (the dirty row and blob-id blocks, in 4 KiB
  pages; for an array that grew, its header too; pages that held only zeros, rows never
  written, as ranges without bytes), with a CRC-32 per 1 MiB page, and writes
  arrays that shrank or changed dtype (or small untracked ones that changed) whole to new
  files ``<name>.<g>.npy``, fsyncs them together and
  renames the before-images into place; (3) writes ``commit.intent`` = ``g``, fsynced; (4)
  writes the changed ranges in place (a grown array's header before its new tail) and fsyncs
  the files together; (5) writes the manifest to
  a temp file, fsyncs, renames it over the old one and fsyncs the directory; (6) removes the before-images and replaced files no reader of the
  last two commits needs, and makes reusable the cold space freed before the previous commit.
* **What a crash leaves.** Before (3): the arrays as commit ``g - 1`` left them (stray files are
  removed by the next writer). Between (3) and (5): the next writer's open (or the writer itself,
  after an error) finds the intent newer than the manifest and writes the before-images back,
  bit-exact. After (5): commit ``g``. A before-image is complete and fsynced before the intent
  names its commit, so a power cut at any point leaves one of the two commits. An intent that
  is garbled or lost counts as none, and the newest before-images in place stand for it (readers
  rebuild from them, the next writer rolls a dead commit back from them).
* **What readers see.** A read-only open maps the array files; each page is copied private and
  checked against its commit's CRC-32 at first use, so the writer's later in-place writes never
  reach a checked page. What an open reads whole (blob index, policy state, written mask) is
  checked page by page through the maps at open and stays the file's pages until first used
  (then copied and checked again); an open that a commit overlapped opens again with private
  copies. A page the writer changed since fails its check and is rebuilt from the
  before-images of the writer's later commits (the last two are kept), and so is the header of
  a file grown in place since, even before its new tail is written; a reader further behind
  gets :class:`~tiered.errors.StaleReadError`. Blob bytes are checked against their checksums at
  every read, and cold space is reused only two commits after it was freed. A process forked from
  the writer keeps private copies of the mapped pages.
* **What ``du`` sees.** One generation plus the before-images of the last two commits (what they
  overwrote of what earlier commits wrote) and the cold segments' reserved tail.
"""
