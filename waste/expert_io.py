"""How the streaming expert store reads a blob (its `io`), named here without importing the
store, so the command line can offer the choice cheaply.

- "direct": with O_DIRECT into page-aligned buffers of the store's own, which evicted blobs
  hand on to later reads; nothing is cached twice. Falls back to "buffered" where the file
  system refuses O_DIRECT.
- "buffered": plain reads into buffers of the store's own (the page cache keeps a second copy
  until the kernel drops it).
- "page-cache": into the page cache, handed out as views of the container's memory map
  (`waste.engine.read_buffers.PageCacheReads`); the page cache also keeps what the cache evicts.

On the 48B q4 container on a 2-core Firecracker VM (2026-12-03, docs/MEASURED.md), "direct"
decoded at 4.6-5.4 tok/s against 1.8-2.4 for "page-cache", whose cold 512-token prefill was
faster (8.4-8.8 against 5.4-5.5 tok/s), and its warm one too (23.7 against 19.8). On that VM memory
new to the guest costs its CPUs 1-3 s per GB: "direct" pays it once per buffer, then reuses the
buffer; "page-cache" pays a first touch on every page the kernel recycles for a new read.
"""

IO_MODES = ("direct", "buffered", "page-cache")

# What `waste run` streams with unless told (--expert-io).
DEFAULT_IO = "direct"
