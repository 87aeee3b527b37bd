"""Training batches from MDS shards (local or remote) with mosaicml-streaming.

What the datasets record beside their shards is read and checked first (:mod:`diffusion.loader.dataset_info`);
the shard checks themselves are :mod:`diffusion.loader.shard_checks`.

Each rank reads a disjoint part of every epoch; the sample order is a function of the shuffle seed and
the number of canonical nodes only, so a resumed run (Composer restores the dataset's state) continues
mid-epoch in the same order. ``data.train.streams`` reads a weighted mix of datasets (streaming's
``Stream`` weights), each as one ``path`` is read; their ``dataset.json`` must agree on what training
depends on, and a later stream's sample keys carry its index. Samples become batches through
:mod:`diffusion.loader.batches`, as the online stream's do: caption dropout substitutes the stored
empty-caption embedding, for a different, reproducible subset of sample keys every epoch.

Reading is zero-copy where it can be: a sample's arrays are views into the memory-mapped shard, and
the only copy is the one collation makes into the batch (streaming's own path copies a sample three
times on the way). Shards streaming does not hold as fixed-shape MDS arrays take streaming's path.
Under a cache limit (``data.train.cache_limit``) the mapped read keeps streaming's bookkeeping as its
own read does: each read touches the shard's access time (streaming evicts the least recently used),
a shard evicted meanwhile is prepared again, and a map of an evicted shard is dropped (a mapped file
keeps its disk blocks after it is deleted): at once by the process that evicts it, by any other
process of the node at its next read or shard preparation (so a worker that waits holds its maps of
shards evicted meanwhile until then: the disk can pass the limit by those). A download counts against
the limit from the moment its room is made, not only once it has landed, so shards downloading at once
(the prefetch and the reading thread, a node's workers) do not each take the same room.

Every shard is checked against index.json before a sample of it is returned, on either path: at
construction, that each shard is there and each file present has the size the index records; once
per node, before its first sample is read, the raw shard's MDS header (sample count and offset table)
and its hash (the fastest the index records: xxh3_64 for the converter's output, xxh64 for one
written before it recorded xxh3_64), unless ``data.train.verify_shards`` is off, in the prefetch
thread where it can be, so the check mostly overlaps reading. Streaming's own ``validate_hash`` covers
what it downloads or decompresses (a compressed shard is checked before it is decompressed), but
not shards already on disk, which is most of them; the raw check covers those. Any mismatch is a
:class:`~diffusion.errors.DataIntegrityError` naming the file and the dataset, raised in the epoch
that meets it (never an epoch that silently ends early), and no sample of a shard that failed is
ever returned.
"""

from __future__ import annotations

import collections
import math
import mmap
import os
import re
import struct
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch
from filelock import FileLock
from streaming import Stream, StreamingDataLoader, StreamingDataset
from streaming.base.constant import CACHE_FILELOCK
from streaming.base.dataset import _ShardState
from streaming.base.format.base.reader import FileInfo
from streaming.base.format.mds.reader import MDSReader

from diffusion import schema
from diffusion.errors import ConfigError, DataIntegrityError, DatasetMismatchError, UserError
from diffusion.storage import share_endpoint_with_streaming
from diffusion.loader.batches import SAMPLE_COPY, SAMPLE_EPOCH, CaptionDropout, NoiseDraws, StackSamples, ToModelBatch
from diffusion.loader.dataset_info import (is_bucketed, is_remote, load_empty_embedding, load_empty_input_ids,
                                           load_empty_tokens,
                                           loader_streams,
                                           one_line, read_dataset_info, read_loader_info, section_name)
from diffusion.loader.captions import CaptionChoice, CaptionColumns
from diffusion.loader.shared_memory import one_registration_at_a_time
from diffusion.loader.shard_checks import (CheckedStream, check_file, default_cache, needs_decompression_cache,
                                           pick_hash, shared_evictions, shared_flags, size_problem)


class _ShardLayout:
    """Where the wanted fixed-shape array columns sit inside one MDS shard's samples.

    An MDS sample is ``[uint32 size of each variable-size column][column bytes, in column order]``;
    a fixed-shape ``ndarray:<dtype>:<shape>`` column is its raw array bytes, an ``int`` column 8 bytes
    of int64 (read as a 0-d array), a ``str`` column UTF-8.
    """

    def __init__(self, reader: MDSReader, wanted: Sequence[str]):
        self.path = os.path.join(reader.dirname, reader.split or "", reader.raw_data.basename)
        missing = sorted(set(wanted) - set(reader.column_names))
        if missing:  # streaming's path names the sample and what it has
            raise ValueError(f"no column {', '.join(missing)}")
        sizes = reader.column_sizes  # None for a variable-size column
        self.header = struct.Struct(f"<{sum(s is None for s in sizes)}I")
        self.columns = []  # (name, dtype, shape, fixed size or None) in column order
        for name, encoding, size in zip(reader.column_names, reader.column_encodings, sizes):
            dtype, shape = None, None
            if name in wanted and encoding == "str":
                dtype = str
            elif name in wanted and encoding == "int":  # streaming's int: int64 (the token counts)
                dtype, shape = np.dtype("<i8"), ()
            elif name in wanted:
                parts = encoding.split(":")
                if parts[0] != "ndarray" or len(parts) != 3:
                    raise ValueError(f"column {name} is {encoding!r}, not a fixed-shape array, int or str")
                dtype, shape = np.dtype(parts[1]), tuple(int(d) for d in parts[2].split(","))
            self.columns.append((name, dtype, shape, size))

        self.fixed_size = self.header.size + sum(s for s in sizes if s is not None)

    def arrays(self, data, begin: int, end: int) -> dict:
        """The wanted columns of the sample in bytes ``begin:end`` of ``data``: arrays as read-only
        views, strings decoded."""
        if end - begin < self.fixed_size:
            raise ValueError(f"the offset table gives it {end - begin} bytes, fewer than its fixed-size columns' "
                             f"{self.fixed_size}")
        sizes = self.header.unpack_from(data, begin)
        if self.fixed_size + sum(sizes) != end - begin:
            raise ValueError(f"its column sizes add up to {self.fixed_size + sum(sizes)} bytes but the offset "
                             f"table gives it {end - begin}")
        variable = iter(sizes)
        offset, out = begin + self.header.size, {}
        for name, dtype, shape, size in self.columns:
            size = next(variable) if size is None else size
            if dtype is str:
                out[name] = data[offset:offset + size].decode("utf-8")
            elif dtype is not None:
                out[name] = np.frombuffer(data, dtype, size // dtype.itemsize, offset).reshape(shape)
            offset += size
        return out


def _counting_exit(thread, it) -> None:
    """Run a streaming prefetch thread's loop on ``it``; where it raises, count the thread's exit first."""
    try:
        thread(it)
    except BaseException:
        it.on_exit()
        raise


class LatentDataset(StreamingDataset):
    """MDS rows → samples: unscaled moments at one resolution, the text column (``text_embeds``, or
    ``input_ids`` when the model encodes them), the sample's key and index, and the epoch it is read in.

    Samples hold numpy arrays (read-only views where possible); :class:`~diffusion.loader.batches.StackSamples`
    turns a list of them into the model's batch. Shards are checked against index.json as the module
    docstring says; ``verify_hashes=False`` keeps the size and header checks and skips the hashes.
    """

    max_open_shards = 256  # memory maps kept open per process

    def __init__(self, *, remote: str | None = None, local: str | None = None, resolution: int,
                 streams: Sequence[CheckedStream] | None = None, verify_hashes: bool = True,
                 text_column: str = schema.TEXT_EMBEDS, captions=None, tokens: bool = False,
                 latent_space: schema.LatentSpace | None = None, pooled: bool = False, **streaming_kwargs: Any):
        if streams is None:  # one dataset; else a weighted mix (each stream checked as this one would be)
            streams = [CheckedStream(remote=remote, local=local)]
        elif remote is not None or local is not None:
            raise ValueError("give remote/local (one dataset) or streams (a mix), not both")
        with one_registration_at_a_time():
            super().__init__(streams=list(streams), **streaming_kwargs)
        self.latent_space = latent_space or schema.LatentSpace()  # which column: moments or latents
        self.moments_column = self.latent_space.column(resolution)
        self.verify_hashes = verify_hashes
        self._epoch = 0
        self.text_column = text_column  # text_embeds, or input_ids for a model that encodes them
        # data.train.captions (a CaptionChoice): each sample's text column is its drawn caption's; a
        # further caption that is empty ("") gives the first one
        self.captions = captions
        # further caption name -> (its text column, its stored text_column[, its token counts])
        self._caption_columns = {}
        for name in (captions.columns if captions is not None else ()):
            if name != schema.CAPTION:
                text, embeds, ids = schema.caption_columns(name)
                self._caption_columns[name] = (text, embeds if text_column == schema.TEXT_EMBEDS else ids,
                                               *((schema.tokens_column(name),) if tokens else ()))
        # the draw among them: the collate step's while iterating (it knows each sample's copy and the
        # run's phase), __getitem__'s for a sample read on its own (copy 0, phase 0)
        self.caption_columns = (CaptionColumns(captions, self._caption_columns, text_column)
                                if self._caption_columns else None)
        self._iterating = False
        # tokens: each sample's token count too (text_tokens, its attention mask; models with model.text_mask)
        # pooled: the second text encoder's pooled vector too (pooled_text_embeds; Flux's two text encoders)
        self.pooled = bool(pooled)
        self._wanted = (self.moments_column, text_column, *((schema.TEXT_TOKENS,) if tokens else ()),
                        *((schema.POOLED_TEXT_EMBEDS,) if pooled else ()), schema.KEY,
                        *(c for pair in self._caption_columns.values() for c in pair))
        self._layouts: dict[int, _ShardLayout | None] = {}
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._failure: BaseException | None = None  # the first error of a prefetch thread or a read
        self._locks, self._locks_pid = {}, os.getpid()
        if verify_hashes:  # what streaming downloads or decompresses: an algorithm every file records
            for stream_id, stream in enumerate(self.streams):
                begin = self.shard_offset_per_stream[stream_id]
                recorded = [set(info.hashes) for shard in self.shards[begin:begin + self.shards_per_stream[stream_id]]
                            for pair in shard.file_pairs for info in pair if info is not None]
                stream.validate_hash = pick_hash(set.intersection(*recorded)) if recorded else None
        self._verified = shared_flags(self)
        # under a cache limit: each shard's evictions on this node, then all of them (a map of a shard
        # made before its latest eviction is of a deleted file), and the total this process last saw
        self._evictions = shared_evictions(self) if self.cache_limit else None
        self._evictions_seen = 0
        self._views = None  # this process's (pid, access times, eviction counts, lock of _maps)
        self._prepared: set[int] = set()  # shards this process saw prepared and checked (no cache limit only)
        self._check_files()

    def __getstate__(self):  # memory maps and locks stay in the process that made them
        state = self.__dict__.copy()
        state["_maps"] = collections.OrderedDict()
        state["_locks"], state["_failure"], state["_views"], state["_prepared"] = {}, None, None, set()
        return state

    def _resume_incr_epoch(self) -> tuple[int, int]:
        # Remember the epoch this worker is iterating: caption dropout differs per epoch.
        epoch, sample_in_epoch = super()._resume_incr_epoch()
        self._epoch = epoch
        return epoch, sample_in_epoch

    # ---- copies of a sample in one epoch -----------------------------------------------------------------
    # An epoch that repeats a sample holds copies streaming tells apart only before it shuffles and
    # partitions them (its "big" sample ids). The resampled ids carry the copy's number through streaming's
    # own work generation (id + copy × num_samples), and each worker takes it off again before reading.

    def resample_streams(self, epoch: int, stream_id: int | None = None):
        units, small_per_big = super().resample_streams(epoch, stream_id)
        return units, small_per_big + self.num_samples * copy_numbers(small_per_big)

    def _get_work(self, epoch: int, sample_in_epoch: int):
        tagged = super()._get_work(epoch, sample_in_epoch)
        read = tagged >= 0  # -1: padding
        self._copies = tagged[read] // self.num_samples  # in the order the samples are yielded
        return np.where(read, tagged % self.num_samples, -1)

    # ---- integrity (see the module docstring) ------------------------------------------------------------

    def _stream(self, shard_id: int) -> Stream:
        return self.streams[self.stream_per_shard[shard_id]]

    @staticmethod
    def _path(stream: Stream, info: FileInfo) -> str:
        return os.path.normpath(os.path.join(stream.local, stream.split, info.basename))

    def _corrupt(self, shard_id: int, info: FileInfo, problem: str) -> DataIntegrityError:
        stream = self._stream(shard_id)
        zip_info = next((z for r, z in self.shards[shard_id].file_pairs if r is info), None)
        if stream.remote not in (None, stream.local):
            fix = "delete it to have it downloaded again"
        elif zip_info is not None and os.path.isfile(self._path(stream, zip_info)):
            fix = f"delete it to have it decompressed again from {zip_info.basename}"
        else:
            fix = "restore it from a copy, or re-convert the dataset"
        return DataIntegrityError(f"shard {self._path(stream, info)} of dataset {stream.remote or stream.local} "
                                  f"{problem}: {fix}")

    def _missing(self, shard_id: int) -> DataIntegrityError:
        stream = self._stream(shard_id)
        raw_info, zip_info = self.shards[shard_id].file_pairs[0]
        return DataIntegrityError(
            f"shard {self._path(stream, zip_info or raw_info)} of dataset {stream.remote or stream.local} is "
            f"missing: index.json lists it but it is not there; restore it from a copy, or re-convert the dataset")

    def _fail(self, error: BaseException) -> BaseException:
        """Remember ``error`` (the first one) and stop the prefetch threads; returns it, to raise."""
        if self._failure is None:
            self._failure = error
        if hasattr(self, "_event"):
            self._event.set()
        return error

    def _check_files(self) -> None:
        """At construction: each shard of a local dataset there, each file present of the size the index
        records (one directory walk and a stat per file present, no file opened)."""
        for stream_id, stream in enumerate(self.streams):
            root = os.path.join(stream.local, stream.split)
            listing = {os.path.normpath(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files}
            begin = int(self.shard_offset_per_stream[stream_id])
            for shard_id in range(begin, begin + int(self.shards_per_stream[stream_id])):
                for pair in self.shards[shard_id].file_pairs:
                    present = [info for info in pair if info is not None and self._path(stream, info) in listing]
                    for info in present:
                        problem = size_problem(os.stat(self._path(stream, info)).st_size, info)
                        if problem:
                            raise self._corrupt(shard_id, info, problem)
                    if not present and stream.remote in (None, stream.local):
                        raise self._missing(shard_id)

    def forget_checks(self) -> None:
        """Forget, on this node, which shards were checked: the next epoch checks each again, as a new
        run's first epoch does (for measuring what the checks cost)."""
        self._verified[:] = 0
        self._maps.clear()
        self._prepared.clear()

    def _lock(self, shard_id: int) -> threading.Lock:
        if self._locks_pid != os.getpid():  # a forked worker: locks are per process
            self._locks, self._locks_pid = {}, os.getpid()
        return self._locks.setdefault(shard_id, threading.Lock())

    def _verify(self, shard_id: int, data=None, wait: bool = True) -> None:
        """Check shard ``shard_id``'s raw files (size, MDS header, hash) unless a process of this node has.
        ``data``: its raw file, already mapped. ``wait=False`` (the prefetch thread) leaves a shard
        another thread of this process is checking to it, and checks the next one meanwhile. Raises
        FileNotFoundError for a file not there (yet)."""
        if self._verified[shard_id]:
            return
        lock = self._lock(shard_id)
        if not lock.acquire(blocking=wait):
            return
        try:
            if self._failure is not None:  # another thread of this process found it bad meanwhile
                raise self._failure
            if self._verified[shard_id]:
                return
            stream, shard = self._stream(shard_id), self.shards[shard_id]
            samples = shard.samples if isinstance(shard, MDSReader) else None
            for raw_info, _ in shard.file_pairs:
                algo = pick_hash(raw_info.hashes) if self.verify_hashes else None
                problem = check_file(self._path(stream, raw_info), raw_info, algo, samples=samples,
                                     data=data if len(shard.file_pairs) == 1 else None)
                if problem:
                    raise self._fail(self._corrupt(shard_id, raw_info, problem))
            self._verified[shard_id] = 1
        finally:
            lock.release()

    def _diagnose(self, shard_id: int, error: BaseException) -> BaseException:
        """The error to raise for a shard that could not be prepared: its file named where it is corrupt
        or missing (or, for a local dataset, could not be read); else ``error`` itself."""
        stream, shard = self._stream(shard_id), self.shards[shard_id]
        present = False
        mds_samples = shard.samples if isinstance(shard, MDSReader) else None
        for raw_info, zip_info in shard.file_pairs:
            for info, samples in ((zip_info, None), (raw_info, mds_samples)):
                if info is None:
                    continue
                try:
                    problem = check_file(self._path(stream, info), info, pick_hash(info.hashes), samples=samples)
                except FileNotFoundError:
                    continue
                present = True
                if problem:
                    return self._corrupt(shard_id, info, problem)
        if stream.remote not in (None, stream.local) and not is_remote(stream.remote):
            # A local directory read through a cache (read-only): is the source file there?
            raw_info, zip_info = shard.file_pairs[0]
            source = os.path.normpath(os.path.join(stream.remote, stream.split, (zip_info or raw_info).basename))
            if not os.path.exists(source):
                return DataIntegrityError(
                    f"shard {source} of dataset {stream.remote} is missing: index.json lists it but it is not "
                    f"there; restore it from a copy, or re-convert the dataset")
        if stream.remote not in (None, stream.local):
            return error
        if not present:
            return self._missing(shard_id)
        raw_info, zip_info = shard.file_pairs[0]
        return DataIntegrityError(
            f"shard {self._path(stream, zip_info or raw_info)} of dataset {stream.local} could not be read "
            f"({type(error).__name__}: {one_line(error)}): restore it from a copy, or re-convert the dataset")

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        """Streaming's download/decompress step (run by its prefetch thread ahead of reading), then the
        shard's check, once its raw file is there; a failure names the file.

        Streaming's prefetch thread calls this once per sample, and streaming's own step makes and takes
        the node's cache file lock each time (to touch the shard's access time for its evictions). Without
        a cache limit nothing is evicted, so a shard this process has seen prepared and checked stays so,
        and the call returns at once: the prefetch threads' CPU in the demo's training went from about 4 s
        to under 1 s per 300 batches (BENCHMARKS.md, "The loader's cache lock per sample")."""
        if shard_id in self._prepared and self._verified[shard_id] and \
                self._shard_states[shard_id] == _ShardState.LOCAL:
            return
        try:
            # a missing shard under a cache limit: its room reserved (read unlocked first: the prefetch thread calls
            # this every sample, and a shard already there takes the cache lock once, in streaming's own step)
            missing = self.cache_limit and self._shard_states[shard_id] == _ShardState.REMOTE
            if not (missing and self._download_in_room(shard_id)):
                super().prepare_shard(shard_id, blocking)
        except DataIntegrityError as e:
            raise self._fail(e)
        except Exception as e:
            if self._shard_states[shard_id] == _ShardState.PREPARING:  # else a waiter would wait forever
                self._shard_states[shard_id] = _ShardState.REMOTE
            diagnosed = self._diagnose(shard_id, e)
            if diagnosed is e:
                raise self._fail(e)
            raise self._fail(diagnosed) from e
        if not self._verified[shard_id] and self._shard_states[shard_id] == _ShardState.LOCAL:
            try:
                self._verify(shard_id, wait=blocking)
            except FileNotFoundError:
                pass  # still compressed, or evicted since: checked when opened
        if self._evictions is not None:  # the prefetch thread too, while the reading thread waits
            _, _, counts, lock = self._cache_views()
            with lock:
                self._drop_evicted(counts)
        elif self._verified[shard_id] and self._shard_states[shard_id] == _ShardState.LOCAL:
            self._prepared.add(shard_id)

    def _download_in_room(self, shard_id: int) -> bool:
        """Streaming's download of a missing shard under a cache limit, with its room reserved until it lands.
        Streaming evicts for a download's room under its cache lock but counts the download only once it has
        landed, so two shards prepared at once (the prefetch and the reading thread, or two workers of the
        node) each found room for one and together passed the limit. Here the room is counted before the lock
        is let go. False where the shard is not missing (streaming's own step waits for it or touches it)."""
        if not hasattr(self, CACHE_FILELOCK):  # made lazily, as streaming does (a FileLock does not pickle)
            self._cache_filelock = FileLock(self._cache_filelock_path)
        lock, states, shard = self._cache_filelock, self._shard_states, self.shards[shard_id]
        with lock:
            if states[shard_id] != _ShardState.REMOTE:
                return False
            states[shard_id] = _ShardState.PREPARING
            room = shard.get_max_size()  # the raw and the compressed file: both are there while it decompresses
            while self.cache_limit < self.cache_usage + room:
                now = states.numpy()
                if not (now == _ShardState.LOCAL).any() and (now == _ShardState.PREPARING).sum() > 1:
                    break  # the room is other downloads' and none has landed: streaming's overshoot, no more
                self._evict_coldest_shard()  # nothing at all to evict: streaming's "cache limit may be too low"
            self.cache_usage += room
        try:
            landed = self._stream(shard_id).prepare_shard(shard)
        except BaseException:
            with lock:
                self.cache_usage -= room
                states[shard_id] = _ShardState.REMOTE
            raise
        with lock:
            self.cache_usage += landed - room
            self._shard_access_times[shard_id] = time.time_ns()
            states[shard_id] = _ShardState.LOCAL
        return True

    # Streaming counts a prefetch thread's exit only where its loop ends without an error, and the epoch's end waits
    # for both threads' counts: a shard that failed in the prefetch thread first (before the reading thread reached
    # it) hung the epoch there for good, where its error was to be raised. A failed thread counts its exit too.
    def _prepare_thread(self, it) -> None:
        _counting_exit(super()._prepare_thread, it)

    def _ready_thread(self, it) -> None:
        _counting_exit(super()._ready_thread, it)

    # Streaming ends an epoch's prefetch threads only where the epoch is read to its end, another starts or a thread
    # fails: one left early (a break, eval_subset_num_batches, a run's last batch mid-epoch) kept both for the life of
    # the process, preparing shards ahead until the read-ahead window filled, then waking every 7 ms. This generator
    # is the epoch's reading; it is closed (or dropped) as the epoch's loop ends, however it ends.
    def _each_sample_id(self, it):
        try:
            yield from super()._each_sample_id(it)
        finally:
            it.non_blocking_exit()  # the threads end at their next step; a new epoch's exit() waits for them

    def on_exception(self, future) -> None:
        # Streaming re-raises a prefetch thread's error in this callback, where no one sees it, and the
        # epoch then ends early without a word: keep it for the reading thread to raise.
        error = future.exception()
        if error is not None:
            self._fail(error)

    def __iter__(self):
        if self._failure is not None:
            raise self._failure
        copies = None
        self._iterating = True  # the collate step draws the captions (StackSamples)
        try:
            for sample in super().__iter__():
                if copies is None:  # set by _get_work, when streaming starts the epoch
                    copies = iter(self._copies.tolist())
                sample[SAMPLE_COPY] = next(copies)
                yield sample
        finally:
            self._iterating = False
        if self._failure is not None:  # a prefetch thread failed after the last sample was read
            raise self._failure

    # ---- reading -----------------------------------------------------------------------------------------

    def _layout(self, shard_id: int) -> _ShardLayout | None:
        if shard_id not in self._layouts:
            shard, layout = self.shards[shard_id], None
            if isinstance(shard, MDSReader):
                try:
                    layout = _ShardLayout(shard, self._wanted)
                except ValueError:
                    layout = None
            self._layouts[shard_id] = layout
        return self._layouts[shard_id]

    def _mapped(self, shard_id: int, layout: _ShardLayout):
        if self._evictions is not None:
            return self._mapped_in_cache(shard_id, layout)
        data = self._maps.get(shard_id)
        if data is None:
            data = self._map(shard_id, layout)
            self._maps[shard_id] = data
            if len(self._maps) > self.max_open_shards:
                self._maps.popitem(last=False)  # closed once no batch views it any more
        else:
            self._maps.move_to_end(shard_id)
        return data

    def _map(self, shard_id: int, layout: _ShardLayout):
        info = self.shards[shard_id].raw_data
        with open(layout.path, "rb") as f:  # FileNotFoundError: not downloaded or decompressed yet
            problem = size_problem(os.fstat(f.fileno()).st_size, info)
            if problem:
                raise self._fail(self._corrupt(shard_id, info, problem))
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._verify(shard_id, data)
        return data

    # ---- under a cache limit: maps as (map, the shard's evictions when it was made) ----------------------

    def _cache_views(self):
        """(pid, streaming's shard access times, the eviction counts, the lock of ``_maps``) of this process,
        the arrays as numpy views of the node's shared memory, made once per process."""
        views = self._views
        if views is None or views[0] != os.getpid():
            with self._lock("views"):
                views = self._views
                if views is None or views[0] != os.getpid():
                    counts = self._evictions  # shared, or this process's where a stale segment was in the way
                    views = self._views = (os.getpid(), self._shard_access_times.numpy(),
                                           counts if isinstance(counts, np.ndarray) else counts.numpy(),
                                           threading.Lock())
        return views

    def _drop_evicted(self, counts: np.ndarray) -> None:
        """Drop the maps of shards evicted since they were made (another process evicted them); under the
        maps' lock."""
        total = int(counts[self.num_shards])
        if total != self._evictions_seen:
            self._evictions_seen = total
            for stale in [s for s, (_, seen) in self._maps.items() if counts[s] != seen]:
                del self._maps[stale]  # unmapped once no sample views it any more

    def _mapped_in_cache(self, shard_id: int, layout: _ShardLayout):
        _, access_times, counts, lock = self._cache_views()
        access_times[shard_id] = time.time_ns()  # a read, as streaming's get_item records it
        with lock:
            self._drop_evicted(counts)
            entry = self._maps.get(shard_id)
            if entry is not None:
                self._maps.move_to_end(shard_id)
                return entry[0]
        seen = int(counts[shard_id])  # before opening: an eviction after it is seen as one
        data = self._map(shard_id, layout)
        with lock:
            self._maps[shard_id] = data, seen
            if len(self._maps) > self.max_open_shards:
                self._maps.popitem(last=False)
        return data

    def _evict_shard(self, shard_id: int) -> None:
        # Streaming's eviction (under its cache lock, in whichever process of the node needs the room),
        # counted once the files are gone, and this process's map of the shard dropped at once.
        super()._evict_shard(shard_id)
        if self._evictions is not None:
            _, _, counts, lock = self._cache_views()
            counts[shard_id] += 1
            counts[self.num_shards] += 1
            with lock:
                self._maps.pop(shard_id, None)  # unmapped once no sample views it any more

    def _open(self, shard_id: int, layout: _ShardLayout):
        """The shard's raw file, mapped and checked; None if it is not there even after preparing it."""
        try:
            return self._mapped(shard_id, layout)
        except FileNotFoundError:
            pass
        self.prepare_shard(shard_id)  # download or decompress it
        try:
            return self._mapped(shard_id, layout)
        except FileNotFoundError:
            return None  # evicted meanwhile: streaming's path below retries

    def _read(self, index: int) -> dict[str, np.ndarray]:
        if self._failure is not None:  # a prefetch thread found a bad shard: stop at once
            raise self._failure
        shard_id, sample_in_shard = self.spanner[index]
        layout = self._layout(shard_id)
        if layout is not None:
            data = self._open(shard_id, layout)
            if data is not None:
                begin, end = struct.unpack_from("<II", data, 4 * (1 + sample_in_shard))
                try:
                    return layout.arrays(data, begin, end)
                except ValueError as e:  # UnicodeDecodeError too
                    raise self._fail(self._corrupt(shard_id, self.shards[shard_id].raw_data,
                                                   f"has a corrupt sample {sample_in_shard} ({one_line(e)})"))
        if not self._verified[shard_id]:
            self.prepare_shard(shard_id)  # there, and checked once there
        row = super().__getitem__(index)
        for name in self._wanted:
            if name not in row:
                raise DatasetMismatchError(f"sample {index} has no column {name} (has {sorted(row)})")
        return {name: row[name] if name == schema.KEY else np.asarray(row[name]) for name in self._wanted}

    def __getitem__(self, index: int) -> dict:
        row = self._read(index)
        if self.num_streams > 1:  # keys are unique within a dataset only: a later stream's are told apart
            stream_id = int(self.stream_per_shard[self.spanner[index][0]])
            if stream_id:
                row[schema.KEY] = f"{stream_id}/{row[schema.KEY]}"
        if self.caption_columns is not None and not self._iterating:
            self.caption_columns.apply(row, self._epoch)
        row[schema.BATCH_SAMPLE_INDEX] = int(index)
        row[SAMPLE_EPOCH] = self._epoch
        return row


def copy_numbers(ids: np.ndarray) -> np.ndarray:
    """For each element of ``ids``, how many equal ones come before it (0 for a first or only copy)."""
    ids = np.asarray(ids)
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    within = np.arange(len(ids)) - np.repeat(starts, np.diff(np.r_[starts, len(ids)]))
    out = np.empty(len(ids), dtype=np.int64)
    out[order] = within
    return out


def _checked_stream(entry, section: str) -> CheckedStream:
    """A local dataset is read in place, except compressed shards whose directory cannot be written (see
    :func:`build_dataset`); a remote one is downloaded into ``entry.local``, by default a cache folder of
    its own that every run of the section reuses (:func:`~diffusion.loader.shard_checks.default_cache`)."""
    path = entry.path
    if is_remote(path):
        share_endpoint_with_streaming()
        remote, local = path, entry.local or default_cache(path, section)
    elif needs_decompression_cache(path):  # read-only: the dataset is the "remote", copied to a cache
        remote, local = path, entry.local or default_cache(path, section)
    else:
        remote, local = None, path
    return CheckedStream(remote=remote, local=local, proportion=entry.proportion, repeat=entry.repeat,
                          choose=entry.choose)


def build_dataset(loader_cfg, *, resolution: int, text_dim: int, device_batch_size: int,
                  text_column: str = schema.TEXT_EMBEDS, seed: int = 0, tokens: bool = False,
                  each_bucket: bool = False) -> LatentDataset | list[LatentDataset]:
    """The dataset of one loader section (``data.train`` or ``data.eval``), checked against the model.

    A local dataset is read in place, except compressed shards whose directory cannot be written (a
    read-only mount, another user's files): those are decompressed into ``local`` (default: a
    directory under the temp dir named by the dataset's path, reused by later runs), the dataset
    read as streaming reads a remote one. A remote dataset is downloaded into ``local`` (default: such
    a directory named by its URI and the section). Two jobs on one node reading the same remote or
    read-only dataset need a ``local`` each. ``data.train.streams`` mixes datasets with streaming's stream
    weights, each stream read (and its shards checked) as a single ``path`` would be. ``each_bucket``: a
    bucketed dataset as a list of datasets, one a bucket (the eval loader's)."""
    info = read_loader_info(loader_cfg, resolution, text_dim)
    captions = caption_choice(loader_cfg, seed)
    section = section_name(loader_cfg)
    streams = [_checked_stream(entry, section) for _, entry in loader_streams(loader_cfg)]
    pooled = info.pooled_text_dim is not None and text_column == schema.TEXT_EMBEDS
    if pooled and captions is not None:
        raise DatasetMismatchError(f"{section}.captions: the datasets store a pooled vector of the "
                                   f"first caption only (Flux's two text encoders): leave the captions out")
    settings = dict(resolution=resolution, batch_size=device_batch_size, text_column=text_column,
                    captions=captions, tokens=tokens, verify_hashes=loader_cfg.verify_shards,
                    latent_space=info.latent_space, pooled=pooled, shuffle=loader_cfg.shuffle,
                    shuffle_seed=loader_cfg.shuffle_seed, predownload=loader_cfg.predownload,
                    cache_limit=loader_cfg.cache_limit, num_canonical_nodes=canonical_nodes(loader_cfg),
                    download_timeout=loader_cfg.download_timeout, epoch_size=loader_cfg.num_samples)
    if each_bucket:
        datasets = [_latent_dataset(section, [stream], settings) for stream in streams]
    else:
        bucketed = {"batching_method": "per_stream"} if is_bucketed(loader_cfg) else {}
        datasets = [_latent_dataset(section, streams, {**settings, **bucketed})]
    for dataset in datasets:
        dataset.empty_pooled = info.empty_pooled() if pooled else None  # what caption dropout substitutes
    return datasets if each_bucket else datasets[0]


def _latent_dataset(section: str, streams: list[CheckedStream], settings: dict) -> LatentDataset:
    """A :class:`LatentDataset` of ``streams``; what streaming refuses as it starts, in one line naming the key."""
    try:
        return LatentDataset(streams=streams, **settings)
    except RuntimeError as error:  # streaming's own words, with a traceback: a conversion that wrote nothing
        empty = re.match(r"Stream contains no samples: (.*?)/?index\.json\.?$", str(error))
        if empty is None:
            raise
        raise DatasetMismatchError(f"{section}: {empty.group(1) or '.'} holds no samples (its "
                                   f"index.json lists none: the conversion wrote none, see its summary's rejects); "
                                   f"convert rows into it, or leave it out") from None
    except ValueError as error:
        if isinstance(error, UserError):
            raise
        low = re.search(r"largest shard size \((\d+) bytes\)", str(error))
        if low is not None:
            raise ConfigError(f"{section}.cache_limit={settings['cache_limit']} is below streaming's minimum for this "
                              f"dataset, 4x its largest shard (raw plus zip): at least "
                              f"{4 * int(low.group(1)):,} bytes; set it well above that, or null") from None
        if str(error).startswith("Minimum cache usage"):  # the indexes alone pass the limit
            raise ConfigError(f"{section}.cache_limit={settings['cache_limit']} is below the size of the datasets' "
                              f"index files ({one_line(error)}); set it well above, or null") from None
        reused = re.match(r"Reused local directory: (\[.*?\]) vs", str(error))
        if reused is not None:  # streaming's machine-wide registration: another live dataset caches there
            raise ConfigError(f"{section}: another job on this machine is reading through the same cache folder "
                              f"{reused.group(1)} (data.*.local, or the default for that remote): give this run a "
                              f"{section}.local of its own") from None
        raise


def canonical_nodes(loader_cfg) -> int:
    """Streaming's ``num_canonical_nodes``: the section's, else 1. Streaming's own default is the number of
    physical nodes, and it sets the sample order (which samples make each global batch), so the same
    config would train other weights on 2 nodes than on 1 (4% apart after 20 batches). Pinned to what one
    node picks (streaming's default shuffle, py1e: the node count), one process and N nodes read the same
    global batches and single-node runs read what they always read; a run resumes with the value its
    checkpoint recorded (streaming's resume state). Set it to the node count for each node to read its own
    shards (less downloading from a remote dataset), the same value on every run that must match."""
    return loader_cfg.num_canonical_nodes or 1


def caption_choice(loader_cfg, seed: int) -> CaptionChoice | None:
    """``captions`` of a loader section as a :class:`CaptionChoice` (keyed by the run's seed), once every
    dataset it reads holds each caption it names; None when it names none."""
    if not getattr(loader_cfg, "captions", None):
        return None
    section = section_name(loader_cfg)
    choice = CaptionChoice.from_mapping(loader_cfg.captions, seed, where=f"{section}.captions")
    for name, entry in loader_streams(loader_cfg):
        held = read_dataset_info(entry.path, loader_cfg.download_timeout).captions or [schema.CAPTION]
        lacking = [c for c in choice.columns if c not in held]
        if lacking:
            raise DatasetMismatchError(
                f"{section}.captions names {', '.join(lacking)}, which {name} does not hold (it holds "
                f"{', '.join(held)}): convert it with --captions {','.join([schema.CAPTION, *lacking])}, or "
                f"leave {'them' if len(lacking) > 1 else 'it'} out")
    return choice


def check_batch_fits(loader_cfg, dataset: LatentDataset, world_size: int = 1) -> None:
    """Refuse a batch larger than an epoch: every batch would be dropped as incomplete, and training
    would wait forever for its first one."""
    per_rank = math.ceil(dataset.epoch_size / world_size)  # streaming pads each rank's share to this
    if per_rank >= loader_cfg.batch_size // world_size:
        return
    section = section_name(loader_cfg)
    if dataset.epoch_size != dataset.num_samples:
        epoch = (f"{dataset.num_samples:,} samples, {dataset.epoch_size:,} per epoch as "
                 f"{section}.num_samples asks")
    else:
        epoch = f"{dataset.num_samples:,} samples"
    names = [entry.path for _, entry in loader_streams(loader_cfg)]
    what = f"dataset {names[0]}" if len(names) == 1 else f"the mix of {section}.streams ({', '.join(names)})"
    raise ConfigError(f"{section}.batch_size {loader_cfg.batch_size:,} is larger than {what}, which "
                      f"holds {epoch}: no full batch can be made; set {section}.batch_size to at most "
                      f"{per_rank * world_size:,}")


SHM_DIR = "/dev/shm"


def shared_memory_needed(dataset) -> int:
    """Bytes of ``/dev/shm`` streaming takes for ``dataset`` on each node: the epoch's sample order (int64 per
    sample of the epoch, every rank's share, written by the node's first rank at the epoch's start) and the
    per-shard state and access-time arrays (and, under a cache limit, eviction counts); the small locks and
    barriers are left out."""
    per_shard = 17 if getattr(dataset, "cache_limit", None) else 9
    return 8 * int(dataset.epoch_size) + per_shard * int(dataset.num_shards)


def check_shared_memory(loader_cfg, dataset) -> None:
    """Refuse, in one line naming the size, a dataset whose shared memory ``/dev/shm`` cannot hold (past
    it streaming dies with a bus error at the first batch: Docker's default is 64 MB)."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:  # no /dev/shm (not Linux): nothing to check
        return
    free, needed = stats.f_bavail * stats.f_frsize, shared_memory_needed(dataset)
    if needed <= free:
        return
    section = section_name(loader_cfg)
    raise ConfigError(f"{section}: streaming needs about {_size(needed)} of shared memory for this dataset "
                      f"({dataset.epoch_size:,} samples an epoch, {dataset.num_shards:,} shards) but {SHM_DIR} has "
                      f"{_size(free)} free: give the node or container more (docker run --shm-size=...), or set "
                      f"{section}.num_samples lower")


def _size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000


def build_dataloader(loader_cfg, *, resolution: int, text_dim: int, world_size: int = 1,
                     seed: int = 0, noise: NoiseDraws | None = None,
                     text_column: str = schema.TEXT_EMBEDS, tokens: bool = False,
                     drop_last: bool = True) -> StreamingDataLoader:
    """A StreamingDataLoader yielding device batches (the global ``batch_size`` split across ranks),
    with each sample's training draws when ``noise`` is given, conditioned on ``text_column``
    (``text_embeds``, or ``input_ids`` for a model with a text encoder: :func:`text_column`), with the
    captions' token counts (``text_tokens``: attention masks) when ``tokens``.

    ``drop_last``: training drops an epoch's last incomplete batch (every step the same size); the eval
    loader keeps it (False), so the held-out loss scores the whole set (:mod:`diffusion.models.held_out_loss`,
    which also counts once the samples streaming repeats to even out the ranks' shares)."""
    if loader_cfg.batch_size % world_size:
        raise ValueError(f"batch_size {loader_cfg.batch_size} does not divide evenly across {world_size} ranks")
    device_batch_size = loader_cfg.batch_size // world_size
    each_bucket = not drop_last and is_bucketed(loader_cfg)  # eval: every sample once, one bucket a batch
    built = build_dataset(loader_cfg, resolution=resolution, text_dim=text_dim, device_batch_size=device_batch_size,
                          text_column=text_column, seed=seed, tokens=tokens, each_bucket=each_bucket)
    datasets = built if each_bucket else [built]
    if drop_last:  # a loader that keeps its last batch reads a set smaller than a batch as one
        check_batch_fits(loader_cfg, built, world_size)
    for dataset in datasets:
        check_shared_memory(loader_cfg, dataset)
    empty = load_empty_embedding(loader_cfg) if text_column == schema.TEXT_EMBEDS else load_empty_input_ids(loader_cfg)
    to_batch = ToModelBatch(resolution, empty, CaptionDropout(loader_cfg.caption_dropout, seed), noise,
                            text_column=text_column, empty_tokens=load_empty_tokens(loader_cfg) if tokens else None,
                            latent_space=datasets[0].latent_space, empty_pooled=datasets[0].empty_pooled)
    workers = loader_cfg.num_workers
    # Its own generator: starting an epoch must not draw from the global RNG the model's noise comes
    # from, or a resumed run (which starts its iterator after restoring the RNG) would drift by a draw.
    loaders = [StreamingDataLoader(
        dataset, batch_size=device_batch_size, num_workers=workers, drop_last=drop_last,
        collate_fn=StackSamples(to_batch, dataset.caption_columns), generator=torch.Generator().manual_seed(seed),
        pin_memory=torch.cuda.is_available(), prefetch_factor=loader_cfg.prefetch_factor if workers else None,
        persistent_workers=loader_cfg.persistent_workers and workers > 0) for dataset in datasets]
    return BucketByBucket(loaders) if each_bucket else loaders[0]


class BucketByBucket:
    """The eval loader of a bucketed set: each bucket's loader in turn, so every batch holds one bucket's
    samples and each bucket's last incomplete batch is kept (streaming's ``per_stream`` batching drops it).
    Sample indices are those of the buckets' concatenation (each bucket's offset added), as the held-out
    loss keys its samples (:mod:`diffusion.models.held_out_loss`). Every rank reads as many batches: each
    bucket's share is evened out across ranks (with repeats the metric counts once)."""

    def __init__(self, loaders: list[StreamingDataLoader]):
        self.loaders = loaders
        self.batch_size = loaders[0].batch_size  # each rank's, as a DataLoader's (Composer's eval microbatch)
        self.offsets = np.cumsum([0] + [loader.dataset.num_samples for loader in loaders[:-1]]).tolist()

    def __len__(self) -> int:
        return sum(len(loader) for loader in self.loaders)

    def __iter__(self):
        for loader, offset in zip(self.loaders, self.offsets):
            for batch in loader:
                batch[schema.BATCH_SAMPLE_INDEX] += offset
                yield batch
