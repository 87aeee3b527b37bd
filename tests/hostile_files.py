"""Hostile files for the converter's and the downloader's tests: memory and decode-time bombs."""

import io
import tarfile

from PIL import Image


def jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each segment of a JPEG, a scan running to the end of its entropy-coded data."""
    i, segments = 2, []
    while i < len(data):
        marker = data[i + 1]
        if marker == 0xD9:  # EOI
            segments.append((marker, i, i + 2))
            break
        end = i + 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:  # SOS: its data ends at the next marker that is not a stuffed 0xFF or a restart
            while True:
                end = data.index(b"\xff", end)
                if data[end + 1] == 0 or 0xD0 <= data[end + 1] <= 0xD7:
                    end += 2
                    continue
                break
        segments.append((marker, i, end))
        i = end
    return segments


def progressive_jpeg(size=(1024, 1024), color=(120, 30, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "JPEG", progressive=True, quality=90)
    return buf.getvalue()


def scan_bomb(repeats: int = 2000, size=(1024, 1024)) -> bytes:
    """A valid progressive JPEG whose last scan (an AC refinement, a few bytes) is repeated ``repeats``
    times: a small file each of whose scans is a pass over every block of the image."""
    data = progressive_jpeg(size)
    _, start, end = [s for s in jpeg_segments(data) if s[0] == 0xDA][-1]
    return data[:end] + data[start:end] * repeats + data[end:]


def sparse_tar(real_size: int = 8 << 30, key: str = "000000000") -> bytes:
    """A 10 KB tar whose member KEY.jpg is a PAX 1.0 sparse file of ``real_size`` bytes (all a hole),
    then KEY.txt: reading the member whole takes ``real_size`` bytes of memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        sparse_map = b"1\n0\n0\n".ljust(512, b"\0")  # one region: offset 0, 0 bytes of data
        info = tarfile.TarInfo(f"GNUSparseFile.0/{key}.jpg")
        info.size = len(sparse_map)
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": f"{key}.jpg",
                            "GNU.sparse.realsize": str(real_size)}
        tar.addfile(info, io.BytesIO(sparse_map))
        info = tarfile.TarInfo(f"{key}.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"a cat"))
    return buf.getvalue()


class _Zeros(io.RawIOBase):
    def __init__(self, n):
        self.left = n

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def gzip_tar_bomb(path, member_size: int, key: str = "000000001") -> None:
    """A gzip-compressed tar (named as given, e.g. 00001.tar) of KEY.jpg, ``member_size`` zero bytes
    (compressing about 1000:1), and KEY.txt."""
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"{key}.jpg")
        info.size = member_size
        tar.addfile(info, io.BufferedReader(_Zeros(member_size)))
        info = tarfile.TarInfo(f"{key}.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"a dog"))
