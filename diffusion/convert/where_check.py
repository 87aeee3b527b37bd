"""Before a conversion starts: its ``--where`` filter can be evaluated on the input and keeps a row.

The grammar is :mod:`diffusion.where` (download and convert both filter with it); checking it against the
input files before any cluster work is the converter's.
"""

from __future__ import annotations

from diffusion.errors import ConfigError
from diffusion.where import RowFilter, parse_where


def check_where(formats: dict[str, str], columns) -> None:
    """Before any cluster work: ``columns.where`` can be evaluated on every input file of ``formats``
    ({file: format}, :func:`diffusion.convert.readers.input_files`; parquet only: tars, tfrecords and
    image folders carry no columns to filter on, refused by name), and keeps at
    least one row (the input is read file by file, only the filter's and the status columns, until a
    row passes; a filter that keeps nothing is an error listing what each rule removed, rather than
    an empty dataset)."""
    from diffusion.convert.failed_inputs import file_errors
    row_filter = parse_where(columns.where)
    other = [(f, fmt) for f, fmt in formats.items() if fmt != "parquet"]
    if other:
        more = f" (and {len(other) - 1} more files that are not parquet)" if len(other) > 1 else ""
        raise ConfigError(f"--where filters parquet columns, but {other[0][0]} is a {other[0][1]} input with no "
                          f"columns to filter on{more}; convert it without --where, or filter its parquet first")
    removed, rows = [0] * len(row_filter.rules), 0
    for uri in formats:
        try:
            for blame in _blame_file(uri, row_filter):
                if None in blame:
                    return
                rows += len(blame)
                for rule in blame:
                    removed[rule] += 1
        except file_errors():
            continue  # unreadable, or lacking a column: the run records it as a failed input
    counts = ", ".join(f"{row_filter.rules[i][0]!r} removed {n}" for i, n in enumerate(removed) if n)
    raise ConfigError(f"--where {row_filter.text!r} keeps no row of the input: {counts or 'no row to filter'} "
                      f"(of {rows} rows); nothing was converted")


def _blame_file(uri: str, row_filter: RowFilter):
    """:meth:`RowFilter.blame` of each batch of a parquet file's sample rows (failed downloads left out)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from diffusion import schema
    from diffusion.storage import filesystem_for
    fs, path = filesystem_for(uri)
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        status = schema.RAW_STATUS in pf.schema_arrow.names
        wanted = list(row_filter.columns) + ([schema.RAW_STATUS] if status else [])
        for batch in pf.iter_batches(batch_size=1 << 16, columns=wanted):
            if status:
                batch = batch.filter(pc.fill_null(pc.equal(batch.column(schema.RAW_STATUS), "success"), False))
            yield row_filter.blame(batch)
