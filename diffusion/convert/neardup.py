"""``--dedupe near`` and ``--dedupe semantic``: duplicates beyond identical bytes, across the whole input.

- ``near``: perceptual near-duplicates (re-encoded, resized, cropped a little, mirrored, colour-jittered):
  each image's :func:`~diffusion.convert.curate.perceptual_vectors` (a mirror-symmetric 16 px colour
  thumbnail, brightness, contrast and saturation normalised away); two images are near-duplicates at a
  cosine >= T (default 0.9).
- ``semantic``: SemDeDup (Abbas et al. 2023) on the ``--embed`` image embeddings: the same comparison
  on the normalised embeddings (default T 0.95).

Whether an image is a duplicate depends on every other image, so it is decided in a pass before the
conversion, never by holding n x n similarities:

1. **embed** (a Ray job, one actor pool over the input files): each file's rows are read as the
   conversion reads them (``--where`` on the input's columns, bad rows, repeated keys and ``--exclude``
   dropped), decoded and cropped by the transform's own code, and their vectors (and with ``--embed``
   every score, the image embedding where ``--store-embeddings`` keeps it, and whether the rows pass
   ``--where``'s rules on scores) written as parquet;
2. **decide** (:func:`duplicate_groups`, in the driver): the passing rows' vectors are clustered with
   scikit-learn's ``MiniBatchKMeans`` (about :data:`CLUSTER_ROWS` rows a cluster, fitted on a sample of
   at most :data:`FIT_SAMPLE` rows and assigned chunk by chunk); within a cluster, rows are ranked by the
   stated rule -- highest ``clip_score`` first (without ``--embed``: all equal), ties in input order -- and a row is removed if its
   similarity to any higher-ranked row of its cluster is >= T (SemDeDup's rule), computed a block of
   rows at a time. Memory: the vectors (n x D float16) plus one block x cluster, never n x n. Pairs
   that k-means puts in different clusters are not compared (SemDeDup's trade: near-duplicates are
   close, so they almost always share a cluster);
3. **convert**: the removed keys are written per input file, and the conversion's read tasks drop
   them before decoding, recorded as ``near_duplicate`` / ``semantic_duplicate``. With ``--embed`` (square
   crops) the conversion's curation stage does not run the model again: it reads each kept row's scores
   (and embedding) from ``curated.parquet`` (:class:`diffusion.convert.curate.FirstPassScores`), the first pass's values for the
   same crop and the same cleaned caption, so the stored columns are the ones the model gives.

The decision is a function of the input and the settings only (files in order, rows in file order,
k-means seeded): a re-run, or a run resumed after a kill at any point, makes the same one, and
``--deterministic`` keeps the same set. Steps 1-2 are kept under a fingerprint of the input files and
the settings (``curate/<fingerprint>/``, complete once ``_done`` is written); a pass killed half-way
is redone whole.

With ``--limit N`` step 1 reads the rows the conversion reads: its own read, limit and drops
(:func:`~diffusion.convert.readers.read_raw`: rows rejected as a file is read are not among the N, rows
excluded by key or image hash are), in input order, the embedding actors fed those rows; so the decision
is the one over an input holding only them, and a copy beyond the N never removes one within them. The
limit is part of the fingerprint, and of the output's recorded settings (a re-run with another limit is
refused before anything is touched: the rows written so far were decided among other rows).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid

import numpy as np

CURATE_DIR = "curate"  # in the output: the first pass's vectors and the removed keys
DEFAULT_THRESHOLDS = {"near": 0.9, "semantic": 0.95}
REASONS = {"near": "near_duplicate", "semantic": "semantic_duplicate"}
CLUSTER_ROWS = 1000  # rows per k-means cluster on average: the within-cluster comparison is m x m
BLOCK = 1024  # rows of a cluster compared at once
FIT_CHUNK = 65536  # rows per k-means partial_fit / predict call
FIT_SAMPLE = 262144  # rows k-means is fitted on (an evenly spaced sample of a larger input)
_DONE = "_done"


# ---- the decision ------------------------------------------------------------------------------------

def cluster_labels(vectors: np.ndarray, clusters: int, seed: int = 0) -> np.ndarray:
    """k-means labels of ``vectors`` (n x D, any float dtype) in ``clusters`` clusters, fitted and assigned
    ``FIT_CHUNK`` rows at a time (float32 copies of a chunk only)."""
    n = len(vectors)
    if clusters <= 1 or n <= 1:
        return np.zeros(n, np.int64)
    from sklearn.cluster import MiniBatchKMeans
    chunk = max(FIT_CHUNK, 3 * clusters)
    km = MiniBatchKMeans(n_clusters=clusters, random_state=seed, batch_size=min(chunk, n), n_init=1,
                         init="random", reassignment_ratio=0.0)
    # fitted on an evenly spaced sample of at most FIT_SAMPLE rows (the centres only route rows to the
    # comparisons; every row is assigned below), one chunk at a time
    step = max(1, n // FIT_SAMPLE)
    sample = np.arange(0, n, step)
    for start in range(0, len(sample), chunk):
        rows = sample[start:start + chunk]
        if len(rows) < clusters:  # partial_fit's first call needs a row per cluster
            rows = sample[max(0, len(sample) - chunk):]
        km.partial_fit(np.asarray(vectors[rows], np.float32))
    labels = np.empty(n, np.int64)
    for start in range(0, n, chunk):
        labels[start:start + chunk] = km.predict(np.asarray(vectors[start:start + chunk], np.float32))
    return labels


def duplicate_groups(vectors: np.ndarray, priority: np.ndarray | None, threshold: float, seed: int = 0,
                     cluster_rows: int = CLUSTER_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """(removed: bool per row, partner: for a removed row, the most similar higher-ranked row of its
    cluster, else -1). Rows are unit vectors; higher ``priority`` ranks first, ties by row order."""
    n = len(vectors)
    removed, partner = np.zeros(n, bool), np.full(n, -1, np.int64)
    if n < 2:
        return removed, partner
    priority = np.zeros(n, np.float32) if priority is None else np.asarray(priority, np.float32)
    labels = cluster_labels(vectors, max(1, n // cluster_rows), seed)
    by_cluster = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[by_cluster], np.arange(labels.max() + 2))
    for c in range(len(bounds) - 1):
        members = by_cluster[bounds[c]:bounds[c + 1]]
        if len(members) < 2:
            continue
        members = members[np.lexsort((members, -priority[members]))]  # best first, ties in input order
        v = np.asarray(vectors[members], np.float32)
        for start in range(0, len(members), BLOCK):
            stop = min(start + BLOCK, len(members))
            sims = v[start:stop] @ v[:stop].T  # each row against every row ranked above it (and the block)
            sims[np.arange(stop)[None, :] >= np.arange(start, stop)[:, None]] = -np.inf
            best = sims.argmax(axis=1)
            dup = sims[np.arange(stop - start), best] >= threshold
            rows = members[start:stop]
            removed[rows[dup]] = True
            partner[rows[dup]] = members[best[dup]]
    return removed, partner


# ---- the first pass ------------------------------------------------------------------------------------

class _EmbedFiles:
    """Ray ``map_batches`` callable (an actor: the models load once): a batch of (path, order) in -- or,
    over the rows ``--limit`` reads, a batch of those rows as :func:`~diffusion.convert.readers.read_raw`
    gives them with their places (``positions=True``) -- and per valid, decodable row its key, file, order,
    position, priority score, whether it passes ``--where``'s score rules, and its vector (float16 bytes)."""

    def __init__(self, formats: dict, names: dict, columns, taken: dict, resolution: int, checks,
                 mode: str, embed: str | None, heads: dict, where: str | None, blocklist=None,
                 cpu_threads: int | None = None, store_embeddings: bool = False):
        self.formats, self.names, self.columns, self.taken = formats, names, columns, taken
        # the transform's own decode, checks and crop, without its tokenizer (this pass reads no tokens):
        # without --embed, an actor that never imports torch or transformers
        self.resolution, self.checks = int(resolution), checks
        self.curator, self.scored = None, ()
        if embed:
            from diffusion.convert.curate import CLIP_SCORE, HEAD_COLUMNS, Curator
            self.curator = Curator(embed, resolution, heads, cpu_threads=cpu_threads)
            self.scored = (CLIP_SCORE, *(HEAD_COLUMNS[kind] for kind in self.curator.heads))
        self.mode, self.where, self.blocklist = mode, where, blocklist
        # the embedding, for the conversion to store without running the model (semantic: it is "vec")
        self.embeds = bool(embed) and store_embeddings and mode != "semantic"

    def _crops(self, batch: dict):
        from diffusion import schema
        from diffusion.rejects import Rejected
        keys, crops, positions, captions = [], [], [], []
        from diffusion.convert.transforms import center_square_crops, clean_caption, decode_image
        res = self.resolution
        for i, (key, caption, data) in enumerate(zip(batch[schema.RAW_KEY], batch[schema.RAW_CAPTION],
                                                     batch[schema.RAW_IMAGE])):
            try:
                caption = clean_caption(caption)  # as the transform: a row it would reject takes no part
                crops.append(center_square_crops(decode_image(data, res, self.checks)[0], [res])[res])
            except Rejected:
                continue
            keys.append(str(key))
            positions.append(i)
            captions.append(caption)  # the cleaned text, as the conversion's curation stage reads it
        return keys, crops, positions, captions

    def _new(self) -> dict:
        out = {"key": [], "file": [], "order": [], "pos": [], "score": [], "passes": [], "vec": [], "embed": []}
        out.update({c: [] for c in self.scored})
        return out

    def _embed(self, out: dict, keys: list, crops: list, captions: list) -> None:
        """Append the scores, whether they pass, the vectors (and embeddings) of decoded rows to ``out``."""
        from diffusion.convert.curate import CLIP_SCORE, failing_rows, finite_rows, perceptual_vectors
        passes = np.ones(len(keys), bool)
        score = np.zeros(len(keys), np.float32)
        if self.curator is not None:
            scores, images = self.curator.scores(crops, captions)
            score = scores[CLIP_SCORE]
            for c in self.scored:
                out[c].append(np.asarray(scores[c], np.float32))
            if self.embeds:
                out["embed"] += [np.asarray(v, np.float16).tobytes() for v in images]
            if self.where:
                passes = failing_rows(self.where, scores, keys, None)
            passes &= finite_rows(scores, keys, None)  # a NaN score: rejected, no part in the decision
        vectors = images if self.mode == "semantic" else perceptual_vectors(crops)
        out["key"] += keys
        out["score"] += [float(s) for s in score]
        out["passes"] += [bool(p) for p in passes]
        out["vec"] += [np.asarray(v, np.float16).tobytes() for v in vectors]

    def _table(self, out: dict):
        import pyarrow as pa
        table = {"key": pa.array(out["key"], pa.string()), "file": pa.array(out["file"], pa.string()),
                 "order": pa.array(out["order"], pa.int64()), "pos": pa.array(out["pos"], pa.int64()),
                 "score": pa.array(out["score"], pa.float32()), "passes": pa.array(out["passes"], pa.bool_()),
                 "vec": pa.array(out["vec"], pa.binary())}
        for c in self.scored:  # every score as the stage computes it (float32), for the conversion to reuse
            table[c] = pa.array(np.concatenate(out[c]) if out[c] else np.zeros(0, np.float32), pa.float32())
        if self.embeds:
            table["embed"] = pa.array(out["embed"], pa.binary())
        return pa.table(table)

    def __call__(self, batch: dict):
        if "path" not in batch:
            yield self._read_rows(batch)
            return
        from diffusion import schema
        from diffusion.convert.dedupe import file_id
        from diffusion.convert.failed_inputs import file_errors
        from diffusion.convert.files import iter_file_batches
        errors = file_errors()
        for uri, order in zip(batch["path"], batch["order"]):
            uri, position = str(uri), 0
            name = self.names[uri]
            out = self._new()
            try:
                for rows in iter_file_batches(uri, self.formats[uri], self.columns, name, None, self.taken):
                    if self.blocklist is not None:
                        blocked = self.blocklist.reasons(rows)
                        if blocked:
                            keep = [i for i, k in enumerate(rows[schema.RAW_KEY]) if k not in blocked]
                            rows = {c: [v[i] for i in keep] for c, v in rows.items()}
                    keys, crops, positions, captions = self._crops(rows)
                    if keys:
                        self._embed(out, keys, crops, captions)
                        out["order"] += [int(order)] * len(keys)
                        out["pos"] += [position + p for p in positions]
                    position += len(rows[schema.RAW_KEY])
            except errors:
                pass  # the conversion records the file as failed; its rows read before the damage count
            out["file"] = [file_id(name)] * len(out["key"])
            yield self._table(out)

    def _read_rows(self, batch: dict):
        """The rows ``--limit`` reads (read, limited and their excluded rows dropped as the conversion
        reads them), with their file's place in the input and their place in it."""
        from diffusion.convert.dedupe import file_id
        from diffusion.convert.readers import ORDER, POS
        if not hasattr(self, "_ids"):
            self._ids = [file_id(self.names[uri]) for uri in self.formats]  # by the file's place in the input
        out = self._new()
        keys, crops, positions, captions = self._crops(batch)
        if keys:
            self._embed(out, keys, crops, captions)
            out["order"] = [int(batch[ORDER][i]) for i in positions]
            out["pos"] = [int(batch[POS][i]) for i in positions]
            out["file"] = [self._ids[o] for o in out["order"]]
        return self._table(out)


def _fingerprint(formats: dict, columns, settings: dict) -> str:
    from diffusion.convert.dedupe import _fingerprint as input_fingerprint
    return hashlib.sha1((input_fingerprint(formats, columns) + json.dumps(settings, sort_keys=True)).encode()
                        ).hexdigest()[:16]


def find_near_duplicates(cfg, out: str, blocklist=None) -> str:
    """Run the first pass and the decision (module docstring) unless an earlier run finished them for
    this input and these settings; returns the folder :func:`removed_keys` reads."""
    import ray
    from ray.data import ActorPoolStrategy
    from diffusion.convert.files import file_names, input_files
    from diffusion.convert.shared_keys import keys_taken_by_earlier_files
    from diffusion.convert.transforms import ImageChecks
    columns = cfg.raw_columns()
    formats = input_files(cfg.input, columns)
    settings = {"mode": cfg.dedupe, "threshold": cfg.threshold(), "embed": cfg.curation_settings(),
                "where": cfg.split_where()[1] if cfg.where else None, "resolution": max(cfg.resolutions),
                "exclude": cfg.exclude_settings(), "checks": [cfg.min_size, cfg.max_aspect, cfg.max_pixels,
                                                             cfg.max_scans]}
    if cfg.limit is not None:  # decided over the first N rows read: another limit, another set of rows
        settings["limit"] = cfg.limit  # (absent without one: a whole-input decision keeps its fingerprint)
    root = os.path.join(out, CURATE_DIR)
    final = os.path.join(root, _fingerprint(formats, columns, settings))
    if os.path.exists(os.path.join(final, _DONE)):
        _remove_others(root, keep=final)
        return final
    os.makedirs(root, exist_ok=True)
    _remove_others(root, keep=None)  # a killed pass's leftovers, or another input's lists
    names = file_names(formats)
    files = list(formats)
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
    cpus = float(ray.cluster_resources().get("CPU", 1))
    gpus = float(ray.cluster_resources().get("GPU", 0)) if cfg.embed else 0.0
    actors = max(1, int(gpus)) if gpus else max(1, int(cpus - max(1.0, 0.1 * cpus)))  # a CPU left for the writes
    checks = ImageChecks(min_size=cfg.min_size, max_aspect=cfg.max_aspect, max_pixels=cfg.max_pixels,
                         max_scans=cfg.max_scans)
    if cfg.limit is None:  # whole files, read and embedded by one actor each
        ds = ray.data.from_items([{"path": f, "order": i} for i, f in enumerate(files)],
                                 override_num_blocks=min(len(files), 1024))
        batch_size, taken = 1, keys_taken_by_earlier_files(formats, names, columns)
    else:  # the rows the conversion's --limit reads: its own read, limit and drops, in input order
        from diffusion.convert.readers import read_raw
        from diffusion.convert.rows import ROWS_PER_BATCH
        ray.data.DataContext.get_current().execution_options.preserve_order = True  # the first N, every run
        ds = read_raw(cfg.input, columns, limit=cfg.limit, blocklist=blocklist, num_cpus=1, positions=True)
        batch_size, taken = ROWS_PER_BATCH, None  # read_raw gives the rows their repeated keys left
    vectors = ds.map_batches(
        _EmbedFiles, batch_size=batch_size, batch_format="numpy",
        fn_constructor_kwargs=dict(formats=formats, names=names, columns=columns, taken=taken,
                                   resolution=max(cfg.resolutions), checks=checks, mode=cfg.dedupe, embed=cfg.embed,
                                   heads=cfg.heads(), where=settings["where"], blocklist=blocklist,
                                   cpu_threads=None if gpus else 1, store_embeddings=cfg.store_embeddings),
        compute=ActorPoolStrategy(size=actors), num_cpus=1, **({"num_gpus": 1} if gpus else {}))
    vectors.write_parquet(os.path.join(tmp, "vectors"))
    decide(tmp, cfg.dedupe, cfg.threshold(), limit=cfg.limit)
    if cfg.embed:
        write_first_pass_scores(tmp, cfg.dedupe)
    with open(os.path.join(tmp, _DONE), "w") as f:
        f.write("")
    os.rename(tmp, final)
    return final


def _remove_others(root: str, keep: str | None) -> None:
    for stale in os.listdir(root) if os.path.isdir(root) else []:
        if os.path.join(root, stale) != keep:
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)


def load_vectors(folder: str):
    """(table of key/file/order/pos/score/passes in input order, n x D float16 vectors) of a first pass."""
    import pyarrow.dataset as pads
    dataset = pads.dataset(os.path.join(folder, "vectors"), format="parquet")
    meta = dataset.to_table(columns=["key", "file", "order", "pos", "score", "passes"])
    order = np.lexsort((meta.column("pos").to_numpy(), meta.column("order").to_numpy()))
    meta = meta.take(order)
    n = meta.num_rows
    vectors = None
    row = 0
    position = np.empty(n, np.int64)
    position[order] = np.arange(n)  # where each row read (in file order) goes in input order
    for batch in dataset.to_batches(columns=["vec"]):
        values = batch.column(0)
        for i in range(len(values)):
            v = np.frombuffer(values[i].as_py(), np.float16)
            if vectors is None:
                vectors = np.empty((n, len(v)), np.float16)
            vectors[position[row]] = v
            row += 1
    return meta, (vectors if vectors is not None else np.zeros((0, 1), np.float16))


def decide(folder: str, mode: str, threshold: float, seed: int = 0, limit: int | None = None) -> dict:
    """Step 2: the removed rows of the passing ones, written per input file as ``removed/file=<id>/``
    (key, reason, the kept row's key); returns counts (``decision.json`` records them, with the ``--limit``
    whose rows the first pass read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    meta, vectors = load_vectors(folder)
    passing = np.flatnonzero(meta.column("passes").to_numpy(zero_copy_only=False))
    scores = meta.column("score").to_numpy()[passing]
    chosen = vectors if len(passing) == len(vectors) else vectors[passing]  # no copy when every row passes
    removed, partner = duplicate_groups(chosen, scores, threshold, seed)
    keys = meta.column("key").to_pylist()
    files = meta.column("file").to_pylist()
    out = os.path.join(folder, "removed")
    by_file: dict[str, list] = {}
    for i in np.flatnonzero(removed):
        kept = i
        while removed[kept]:  # the removed row's partner may be removed too: follow to a kept row
            kept = partner[kept]
        row, kept_row = passing[i], passing[kept]
        by_file.setdefault(files[row], []).append((keys[row], keys[kept_row]))
    for file, rows in by_file.items():
        os.makedirs(os.path.join(out, f"file={file}"), exist_ok=True)
        pq.write_table(pa.table({"key": [k for k, _ in rows], "kept": [k for _, k in rows]}),
                       os.path.join(out, f"file={file}", "removed.parquet"))
    os.makedirs(out, exist_ok=True)
    counts = {"rows": int(len(meta)), "passing": int(len(passing)), "removed": int(removed.sum())}
    with open(os.path.join(folder, "decision.json"), "w") as f:
        json.dump({"mode": mode, "threshold": threshold, "limit": limit, **counts}, f)
    return counts


SCORES_FILE = "curated.parquet"  # in a first pass's folder (--embed): each row's scores, sorted by key
SCORES_GROUP = 65536  # rows per row group: the unit FirstPassScores reads


def write_first_pass_scores(folder: str, mode: str) -> None:
    """``curated.parquet`` of a first pass with ``--embed``: key, every score (float32) and, where stored,
    the embedding (float16 bytes), sorted by key in row groups of :data:`SCORES_GROUP` whose first keys
    the file's metadata lists (:class:`diffusion.convert.curate.FirstPassScores` finds a key's group by them)."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq
    from diffusion.convert.curate import SCORES
    dataset = pads.dataset(os.path.join(folder, "vectors"), format="parquet")
    names = dataset.schema.names
    columns = ["key", *(c for c in SCORES if c in names)]
    embed = "vec" if mode == "semantic" else "embed" if "embed" in names else None
    table = dataset.to_table(columns=columns + ([embed] if embed else []))
    if embed:
        table = table.rename_columns(columns + ["embed"])
    table = table.sort_by("key")
    firsts = [table.column("key")[i].as_py() for i in range(0, table.num_rows, SCORES_GROUP)]
    width = len(table.column("embed")[0].as_py()) // 2 if embed and table.num_rows else 0
    table = table.replace_schema_metadata({"first_keys": json.dumps(firsts), "width": str(width)})
    path = os.path.join(folder, SCORES_FILE)
    pq.write_table(table, path, row_group_size=SCORES_GROUP)
    meta = pq.ParquetFile(path).metadata
    if [meta.row_group(i).num_rows for i in range(meta.num_row_groups)][:-1] != [SCORES_GROUP] * (len(firsts) - 1):
        os.remove(path)  # groups not where the index says: the conversion runs the model instead


def first_pass_scores(folder: str | None, cfg) -> str | None:
    """The ``curated.parquet`` the conversion's curation stage may read instead of running the model, or
    None: no first pass, no ``--embed``, buckets (the stage scores each row's bucket crop, the first pass
    its centre square), or a pass written before the file existed (or without the embeddings to store)."""
    if not folder or cfg.embed is None or cfg.buckets:
        return None
    path = os.path.join(folder, SCORES_FILE)
    if not os.path.isfile(path):
        return None
    import pyarrow.parquet as pq
    names = pq.read_schema(path).names
    if any(c not in names for c in cfg.computed_columns()) or (cfg.store_embeddings and "embed" not in names):
        return None
    return path


def removed_keys(folder: str | None, name: str, reason: str) -> dict[str, str]:
    """{key: reason} of the input file ``name``'s removed rows."""
    if not folder:
        return {}
    from diffusion.convert.dedupe import file_id
    path = os.path.join(folder, "removed", f"file={file_id(name)}", "removed.parquet")
    if not os.path.isfile(path):
        return {}
    import pyarrow.parquet as pq
    return {k: reason for k in pq.read_table(path, columns=["key"]).column("key").to_pylist()}


def removed_groups(folder: str) -> dict[str, list[str]]:
    """{kept key: [removed keys]} of a decision, for --visualize-duplicates."""
    import pyarrow.dataset as pads
    path = os.path.join(folder, "removed")
    groups: dict[str, list[str]] = {}
    if not any(os.scandir(path)):
        return groups
    table = pads.dataset(path, format="parquet").to_table(columns=["key", "kept"])
    for key, kept in zip(table.column("key").to_pylist(), table.column("kept").to_pylist()):
        groups.setdefault(kept, []).append(key)
    return {k: sorted(v) for k, v in sorted(groups.items())}


def visualize_duplicates(cfg, folder: str, out_png: str, n: int, side: int = 96) -> int:
    """Draw ``n`` removed groups, one a row: the kept image, then the removed ones; returns rows drawn."""
    from PIL import Image, ImageDraw
    from diffusion import schema
    from diffusion.convert.readers import iter_rows
    groups = dict(list(removed_groups(folder).items())[:n])
    if not groups:
        return 0
    wanted = set(groups) | {k for v in groups.values() for k in v}
    images = {}
    for row in iter_rows(cfg.input, cfg.raw_columns(), on_failed_file=lambda *_: None):
        if row[schema.RAW_KEY] in wanted:
            images[row[schema.RAW_KEY]] = row[schema.RAW_IMAGE]
    width = 1 + max(len(v) for v in groups.values())
    sheet = Image.new("RGB", (width * side, len(groups) * (side + 14)), "white")
    draw = ImageDraw.Draw(sheet)
    import io
    for r, (kept, removed) in enumerate(groups.items()):
        for c, key in enumerate([kept, *removed]):
            try:
                with Image.open(io.BytesIO(images[key])) as im:
                    thumb = im.convert("RGB")
                    thumb.thumbnail((side - 4, side - 4))
            except Exception:
                continue
            sheet.paste(thumb, (c * side + 2, r * (side + 14) + 14))
            draw.text((c * side + 2, r * (side + 14)), ("kept " if c == 0 else "") + key[:12], fill="black")
    sheet.save(out_png)
    return len(groups)
