"""A Spark DataFrame as training data for the ranks: written once as Parquet by the driver, read
back by each rank as NumPy arrays, either whole or as that rank's shard of equal length.

What Horovod's Spark Estimators (``horovod.spark.keras.KerasEstimator``, ``.torch.TorchEstimator``)
did with a ``Store`` and Petastorm, whose last release (0.13.1) no longer imports on current
pyarrow (``pyarrow.filesystem`` was removed), so the Estimators cannot read their data::

    data = hvdtrain.spark.save_dataframe(df, "/shared/store/train", columns=["features", "label"])

    def main(data):
        import horovod.torch as hvd
        hvd.init()
        part = data.shard(hvd.rank(), hvd.size())  # {"features": (n, F), "label": (n,)}
        ...

    hvdtrain.spark.run(main, 2, args=(data,))

Only pyarrow is needed on the ranks (pyspark ships it); the driver needs pyspark.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from hvdtrain import runtime


@dataclass(frozen=True)
class SavedDataFrame:
    """A DataFrame saved by :func:`save_dataframe`: its Parquet files, in row order.

    Attributes:
        path: the folder: an absolute local path on a file system every executor shares, or a
            URI pyarrow opens, e.g. ``hdfs://...``.
        columns: the saved columns, in order.
        files: ``(file name, rows)`` of each non-empty Parquet file, in row order.
        shapes: each column's shape per row (``()`` for a scalar, ``(F,)`` for a vector or an
            array of F numbers).
    """
    path: str
    columns: tuple[str, ...]
    files: tuple[tuple[str, int], ...]
    shapes: dict

    @property
    def rows(self) -> int:
        """Rows saved."""
        return sum(n for _, n in self.files)

    def __len__(self) -> int:
        return self.rows

    def shard_rows(self, size: int, drop_last: bool = False) -> int:
        """Rows each of ``size`` ranks gets from :meth:`shard`: ``ceil(rows / size)`` (the last
        ranks' shards padded from the start of the data, as ``torch.utils.data
        .DistributedSampler`` pads), or ``rows // size`` with ``drop_last``.

        Raises:
            ValueError: ``size`` below 1, or ``drop_last`` with fewer rows than ranks.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a whole number of ranks >= 1, not {size!r}")
        per = self.rows // size if drop_last else math.ceil(self.rows / size)
        if per == 0:
            raise ValueError(f"{self.rows} row(s) for {size} ranks with drop_last=True: every "
                             "rank would get none; save more rows or set drop_last=False")
        return per

    def shard(self, rank: int | None = None, size: int | None = None, *,
              columns: list[str] | None = None, drop_last: bool = False) -> dict:
        """Rank ``rank``'s contiguous block of the saved rows, the same number of rows on every
        rank (:meth:`shard_rows`), so that every rank takes the same number of steps (a rank
        with one batch more would wait forever in its extra all-reduce). Only the Parquet row
        groups that hold the block are read.

        Args:
            rank, size: default: the launcher's (``HOROVOD_RANK``/``HOROVOD_SIZE``, as Horovod's
                launchers and :func:`hvdtrain.spark.run` set them).
            columns: a subset of the saved columns (default: all).
            drop_last: drop the rows that do not divide among the ranks instead of padding.

        Returns:
            ``{column: array (n, *shape)}``, ``n`` = :meth:`shard_rows`; numbers keep their
            Parquet type (Spark's float: float32, double: float64, int: int32, long: int64).

        Raises:
            ValueError: ``rank`` outside ``[0, size)``, an unknown column, or as :meth:`shard_rows`.
        """
        rank = runtime.launcher_rank() if rank is None else rank
        size = runtime.launcher_size() if size is None else size
        per = self.shard_rows(size, drop_last)
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), not {rank!r}")
        start, n = rank * per, self.rows
        # Padded positions past the end wrap around to the first rows.
        pieces, pos = [], start
        while pos < start + per:
            begin = pos % n
            take = min(start + per - pos, n - begin)
            pieces.append((begin, begin + take))
            pos += take
        return self._read(pieces, self._columns(columns))

    def read(self, columns: list[str] | None = None) -> dict:
        """Every saved row (for data that fits in each rank's memory, sharded by index afterwards,
        e.g. with ``DistributedSampler`` or ``hvdtrain.keras.shard_dataset``).

        Returns:
            ``{column: array (rows, *shape)}``.

        Raises:
            ValueError: an unknown column.
        """
        return self._read([(0, self.rows)], self._columns(columns))

    def _columns(self, columns) -> list[str]:
        columns = list(self.columns if columns is None else columns)
        unknown = [c for c in columns if c not in self.columns]
        if unknown:
            raise ValueError(f"unknown column(s) {unknown}: {self.path} holds "
                             f"{list(self.columns)}")
        return columns

    def _read(self, pieces: list[tuple[int, int]], columns: list[str]) -> dict:
        import pyarrow as pa
        import pyarrow.parquet as pq
        fs, root = _filesystem(self.path)
        tables = []
        for begin, end in pieces:
            offset = 0
            for name, rows in self.files:
                lo, hi = max(begin, offset), min(end, offset + rows)
                if lo < hi:
                    tables.append(_read_rows(pq, fs, f"{root}/{name}", lo - offset,
                                             hi - offset, columns))
                offset += rows
        table = pa.concat_tables(tables)
        return {c: _to_numpy(table.column(c), c, self.shapes[c]) for c in columns}


def _read_rows(pq, fs, path: str, lo: int, hi: int, columns: list[str]):
    """Rows ``[lo, hi)`` of one Parquet file, reading only the row groups that hold them."""
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        groups, first, offset = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            if offset < hi and offset + rows > lo:
                first = offset if first is None else first
                groups.append(g)
            offset += rows
        table = pf.read_row_groups(groups, columns=columns)
    return table.slice(lo - first, hi - lo)


def _to_numpy(column, name: str, shape: tuple) -> np.ndarray:
    """A column of ``n`` rows as ``(n, *shape)``; lists of numbers flattened level by level."""
    import pyarrow as pa
    array = column.combine_chunks()
    n = len(array)
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    return values.reshape((n, *shape))


def _normal_path(path: str) -> str:
    """``path`` as every process reads it alike: a local path made absolute (the ranks run in
    the executors' working directories), Databricks' ``dbfs:/x`` as its FUSE mount ``/dbfs/x``,
    a URI as it is."""
    path = os.fspath(path)
    if path.startswith("dbfs:/") and not path.startswith("dbfs://"):
        return "/dbfs/" + path[len("dbfs:/"):].lstrip("/")
    return path if "://" in path else os.path.abspath(path)


def _filesystem(path: str):
    """``(pyarrow file system, path on it)`` for a local path or a URI; Hadoop's ``s3a://`` and
    ``s3n://`` are pyarrow's ``s3://``."""
    from pyarrow import fs
    if "://" in path:
        scheme, rest = path.split("://", 1)
        if scheme in ("s3a", "s3n"):
            path = "s3://" + rest
        return fs.FileSystem.from_uri(path)
    return fs.LocalFileSystem(), path


def _spark_path(path: str) -> str:
    """The path Spark writes to: a local path made explicit (``file://``; Spark's default file
    system may be HDFS), Databricks' FUSE mount ``/dbfs/x`` as ``dbfs:/x`` (what Horovod's
    ``DBFSLocalStore`` did), a URI as it is."""
    if "://" in path:
        return path
    if path.startswith("/dbfs/"):
        return "dbfs:" + path[len("/dbfs"):]
    return "file://" + path


def _spark_columns(df, columns: list[str]):
    """``(columns to select, shape checks)``: Spark ML vectors become arrays of float64
    (``vector_to_array``); numbers, booleans and (nested) arrays of them are kept; other types
    are refused, naming the column."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    numeric = (T.NumericType, T.BooleanType)
    fields = {f.name: f.dataType for f in df.schema.fields}
    missing = [c for c in columns if c not in fields]
    if missing:
        raise ValueError(f"column(s) {missing} are not in the DataFrame; it has {list(fields)}")
    selected = []
    for c in columns:
        kind = fields[c]
        if type(kind).__name__ == "VectorUDT":  # pyspark.ml.linalg's or pyspark.mllib's
            from pyspark.ml.functions import vector_to_array
            selected.append(vector_to_array(F.col(c)).alias(c))
            continue
        inner = kind
        while isinstance(inner, T.ArrayType):
            inner = inner.elementType
        if isinstance(inner, T.DecimalType) or not isinstance(inner, numeric):
            raise ValueError(f"column {c!r} is {kind.simpleString()}: save numbers, booleans, "
                             "arrays of them or Spark ML vectors (cast or encode it first, e.g. "
                             "StringIndexer for string labels)")
        selected.append(F.col(c))
    return selected


def _check_rows(out, columns: list[str]) -> tuple[int, dict]:
    """``(rows, {column: shape per row})`` of the selected DataFrame, from one Spark aggregation
    (before anything is written): every column free of nulls, and every array of a column, at
    every level, of one length.

    Raises:
        ValueError: no rows, a null, or arrays of different lengths in one column.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    kinds = {f.name: f.dataType for f in out.schema.fields}
    aggs, levels = [F.count(F.lit(1)).alias("rows")], {}
    for i, c in enumerate(columns):
        aggs.append(F.count(F.when(F.col(c).isNull(), 1)).alias(f"n{i}"))
        kind, level, flat = kinds[c], 0, F.col(c)
        while isinstance(kind, T.ArrayType):
            # flat: an array of this level's arrays (level 0: the row's own array).
            sizes = F.size(flat) if level == 0 else F.transform(flat, F.size)
            lo, hi = (sizes, sizes) if level == 0 else (F.array_min(sizes), F.array_max(sizes))
            inner = flat if level == 0 else F.flatten(flat)  # this level's values, all rows
            aggs += [F.min(lo).alias(f"lo{i}_{level}"), F.max(hi).alias(f"hi{i}_{level}"),
                     F.count(F.when(F.exists(inner, lambda x: x.isNull()), 1))
                     .alias(f"in{i}_{level}")]
            flat = inner
            kind, level = kind.elementType, level + 1
        levels[c] = level
    got = out.agg(*aggs).first().asDict()
    if not got["rows"]:
        raise ValueError("the DataFrame has no rows: nothing to train on")
    shapes = {}
    for i, c in enumerate(columns):
        if got[f"n{i}"]:
            raise ValueError(f"column {c!r} has {got[f'n{i}']} null(s): drop or fill them "
                             "before saving (df.na.drop() or df.na.fill())")
        shape = []
        for level in range(levels[c]):
            lo, hi, nulls = got[f"lo{i}_{level}"], got[f"hi{i}_{level}"], got[f"in{i}_{level}"]
            if nulls or lo != hi:
                raise ValueError(f"column {c!r} holds arrays of {lo} to {hi} values"
                                 f"{' and nulls inside them' if nulls else ''}: every row needs "
                                 "the same shape")
            shape.append(lo or 0)
        shapes[c] = tuple(shape)
    return got["rows"], shapes


def save_dataframe(df, path: str, columns: list[str] | None = None, *, shuffle: bool = True,
                   seed: int = 0, overwrite: bool = False) -> SavedDataFrame:
    """Write ``df`` as Parquet to ``path`` for the ranks of :func:`hvdtrain.spark.run` to read
    (:meth:`SavedDataFrame.shard` or :meth:`SavedDataFrame.read`).

    Runs one Spark job that checks the rows (no nulls, one shape per column), then one that
    writes the files (sorted by a random key with ``shuffle``); the driver then reads the
    files' footers for their row counts. Spark ML vector columns (``VectorAssembler``'s output)
    are saved as arrays of float64.

    Args:
        df: a Spark DataFrame (a classic or a Spark Connect session).
        path: a new or empty folder that the driver and every executor see: a shared local
            path (relative ones are made absolute on the driver; ``/dbfs/...`` or ``dbfs:/...``
            on Databricks), or an ``hdfs://`` or ``s3://`` URI (``s3a://`` for Spark on Hadoop
            is read as ``s3://``; pyarrow opens it on the ranks).
        columns: the columns to save (default: all), e.g. features and label.
        shuffle: save the rows in a random order (``seed``), so that each rank's contiguous
            shard is a random sample even when ``df`` is sorted (e.g. by label).
        overwrite: replace what ``path`` holds instead of refusing.

    Returns:
        A :class:`SavedDataFrame`, small and picklable: pass it to the ranks in ``args``.

    Raises:
        ValueError: before anything is written: an unknown or repeated column, one of a type
            that is not a number, a boolean, an array of them or a vector, ``path`` not empty
            without ``overwrite``, no rows, a null, or arrays of different lengths in one
            column.
        RuntimeError: the driver does not find the rows the executors wrote (``path`` is not
            shared, or the DataFrame gives other rows when computed again).
    """
    import pyarrow.parquet as pq
    from pyarrow.fs import FileSelector, FileType
    columns = list(df.columns if columns is None else columns)
    if not columns:
        raise ValueError("no columns to save")
    if len(set(columns)) != len(columns):
        raise ValueError(f"columns {columns} name a column twice")
    selected = _spark_columns(df, columns)
    path = _normal_path(path)
    fs, root = _filesystem(path)
    exists = fs.get_file_info(root).type != FileType.NotFound
    if exists and not overwrite and fs.get_file_info(FileSelector(root)):
        raise ValueError(f"{path} is not empty: give a new folder or overwrite=True")
    out = df.select(*selected)
    rows, shapes = _check_rows(out, columns)
    if shuffle:
        from pyspark.sql import functions as F
        out = out.orderBy(F.rand(seed))
    # An empty folder that exists (mkdtemp) is written into: nothing in it to lose.
    mode = "overwrite" if overwrite or exists else "errorifexists"
    out.write.mode(mode).parquet(_spark_path(path))
    parts = sorted(i.base_name for i in fs.get_file_info(FileSelector(root))
                   if i.type == FileType.File and i.base_name.endswith(".parquet")
                   and not i.base_name.startswith(("_", ".")))
    files = []
    for name in parts:  # Spark numbers its part files in row order: part-00000-..., part-00001-...
        with fs.open_input_file(f"{root}/{name}") as f:
            n = pq.ParquetFile(f).metadata.num_rows
        if n:
            files.append((name, n))
    saved = SavedDataFrame(path=path, columns=tuple(columns), files=tuple(files), shapes=shapes)
    if saved.rows != rows:
        raise RuntimeError(f"Spark counted {rows} rows but {path} holds {saved.rows} in "
                           f"{len(files)} Parquet file(s): either the driver does not see the "
                           "folder the executors wrote, or the DataFrame gives other rows each "
                           "time it is computed (an unseeded sample, a limit without an order, "
                           "a changing source: df.cache() or seed it)")
    return saved
