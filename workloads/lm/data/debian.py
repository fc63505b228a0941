"""An English corpus from pinned Debian bookworm packages, read with the standard library alone.

Each package in ``PACKAGES`` is one ``.deb`` from ``deb.debian.org``'s pool, pinned by version
and sha256. ``fetch`` downloads and verifies it; ``read_deb`` opens it (the ``ar`` archive and
its ``data.tar.xz``) without external tools; ``documents`` turns its files into
``(doc_id, text)`` pairs of plain English, in a fixed order: the same bytes in, the same
documents out. A document is a Bible or commentary chapter, a section of a book, or a run of
consecutive dictionary entries, and none is longer than ``MAX_DOC_CHARS`` (longer ones are cut
at paragraph breaks into numbered parts), so that a split by hash of ``doc_id`` is balanced.

``python -m workloads.lm.data.debian CACHE_DIR`` downloads every package into ``CACHE_DIR``
and prints, per package, the ``.deb``'s size, sha256 and licence and the documents' count,
characters and whitespace-separated words.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import http.client
import io
import os
import re
import struct
import sys
import tarfile
import tempfile
import time
import unicodedata
import urllib.request
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

POOL_URL = "http://deb.debian.org/debian/pool/main/"
DOWNLOAD_TIMEOUT_S = 60
MAX_DOC_CHARS = 60_000


@dataclass(frozen=True)
class Package:
    """One pinned ``.deb``: where it lies in the pool, its sha256, and what its text is."""

    name: str
    version: str
    path: str  # under POOL_URL
    sha256: str
    license: str  # of the text, from /usr/share/doc/<name>/copyright
    description: str


PACKAGES: dict[str, Package] = {p.name: p for p in [
    Package("dict-gcide", "0.48.5+nmu2", "d/dict-gcide/dict-gcide_0.48.5+nmu2_all.deb",
            "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f", "GPL-2.0-or-later",
            "GNU Collaborative International Dictionary of English (Webster 1913 + WordNet)"),
    Package("anarchism", "15.3-3", "a/anarchism/anarchism_15.3-3_all.deb",
            "cf21c10948b00e923c62eb31c39a3390413fa26c5ee0e3b925feb0ec7fe42948", "GPL-2.0-or-later",
            "An Anarchist FAQ, the 2017 edition (political essays)"),
    Package("sword-comm-tdavid", "2.1-1", "s/sword-comm-tdavid/sword-comm-tdavid_2.1-1_all.deb",
            "bcbfad701c5c4a061475b58309cebc42755a59e87478c8355227c5e046412b3f", "public-domain",
            "C. H. Spurgeon's Treasury of David, a commentary on the Psalms (1885)"),
    Package("sword-comm-mhcc", "2.0-1", "s/sword-comm-mhcc/sword-comm-mhcc_2.0-1_all.deb",
            "06f748215de78ff48fdfdee93e3ffc5af6318b976485f7aedf22309236967e35", "public-domain",
            "Matthew Henry's Concise Commentary on the Whole Bible"),
    Package("sword-text-web", "426.0-1", "s/sword-text-web/sword-text-web_426.0-1_all.deb",
            "930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1", "public-domain",
            "World English Bible with Deuterocanon (modern English)"),
    Package("r-cran-janeaustenr", "1.0.0-1",
            "r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb",
            "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95", "MIT",
            "Jane Austen's six completed novels"),
]}


class FetchError(RuntimeError):
    """A package could not be downloaded, or its bytes are not the pinned ones."""


def fetch(package: str, cache_dir: str | os.PathLike) -> Path:
    """The verified ``.deb`` of ``package`` in ``cache_dir``, downloaded unless already there.

    Returns the file's path. Raises ``KeyError`` for a package not in ``PACKAGES`` and
    ``FetchError`` (one line naming the package) when the download fails or its sha256 is not
    the pinned one; nothing is left at the path then.
    """
    pkg = PACKAGES[package]
    cache = Path(cache_dir)
    dest = cache / pkg.path.rsplit("/", 1)[1]
    if dest.is_file() and _sha256_file(dest) == pkg.sha256:
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    url = POOL_URL + pkg.path
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{pkg.name}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(
                url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != pkg.sha256:
            raise FetchError(f"{package}: sha256 of {url} is {digest.hexdigest()}, "
                             f"pinned {pkg.sha256}")
        os.replace(tmp, dest)
    except (OSError, http.client.HTTPException) as e:  # URLError and HTTPError are OSErrors
        raise FetchError(f"{package}: cannot download {url}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _sha256_file(path: Path) -> str:
    """The hex sha256 of the file at ``path``."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_deb(path: str | os.PathLike) -> dict[str, bytes]:
    """The regular files of the ``.deb`` at ``path``: ``{path without "./": bytes}``.

    Parses the ``ar`` archive and opens its ``data.tar.xz``, ``.gz``, ``.bz2`` or plain tar.
    Raises ``ValueError`` when the file is not a ``.deb``, or when its data is zstd-compressed,
    which the standard library cannot read.
    """
    with open(path, "rb") as f:
        blob = f.read()
    if not blob.startswith(b"!<arch>\n"):
        raise ValueError(f"{path}: not an ar archive")
    pos = 8
    while pos + 60 <= len(blob):
        header = blob[pos:pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii"))
        if header[58:60] != b"`\n":
            raise ValueError(f"{path}: corrupt ar member header at offset {pos}")
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise ValueError(f"{path}: {name} is zstd-compressed; the standard library "
                                 "cannot read it")
            data = blob[pos + 60:pos + 60 + size]
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                return {m.name.removeprefix("./"): tar.extractfile(m).read()
                        for m in tar.getmembers() if m.isfile()}
        pos += 60 + size + size % 2
    raise ValueError(f"{path}: no data.tar member")


def documents(package: str, cache_dir: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """The ``(doc_id, text)`` pairs of ``package``, fetched into ``cache_dir``, in a fixed order.

    Texts longer than ``MAX_DOC_CHARS`` come as parts ``<doc_id>/<n>`` cut at paragraph breaks.
    Raises what ``fetch`` and ``read_deb`` raise, and ``ValueError`` for files that do not
    have the expected layout.
    """
    files = read_deb(fetch(package, cache_dir))
    for doc_id, text in _EXTRACTORS[package](files):
        if text:
            yield from _cap(doc_id, text)


def _cap(doc_id: str, text: str) -> Iterator[tuple[str, str]]:
    """``(doc_id, text)`` itself when short enough, else its parts ``(doc_id/<n>, part)``, each
    of whole paragraphs and at most ``MAX_DOC_CHARS`` characters unless one paragraph is."""
    if len(text) <= MAX_DOC_CHARS:
        yield doc_id, text
        return
    parts: list[list[str]] = [[]]
    size = 0
    for para in text.split("\n\n"):
        if parts[-1] and size + len(para) > MAX_DOC_CHARS:
            parts.append([])
            size = 0
        parts[-1].append(para)
        size += len(para) + 2
    for n, part in enumerate(parts):
        yield f"{doc_id}/{n:02d}", "\n\n".join(part)


_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\xad]")


def _paragraphs(text: str, keep_lines: bool = False) -> str:
    """``text`` with blank-line-separated paragraphs kept, runs of blank lines made one, spaces
    collapsed, control characters and soft hyphens dropped; a paragraph's lines joined by a
    space, or (``keep_lines``) kept, empty ones dropped."""
    paras = []
    for para in re.split(r"\n[ \t\r\f\v]*\n", _CONTROLS.sub("", text)):
        lines = (" ".join(line.split()) for line in para.split("\n"))
        para = "\n".join(line for line in lines if line) if keep_lines else " ".join(para.split())
        if para:
            paras.append(para)
    return "\n\n".join(paras)


# --- dictd dictionaries: <name>.index (headword, base64 offset, base64 length) + <name>.dict.dz

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_entries(files: Mapping[str, bytes], name: str, encoding: str) -> list[str]:
    """The entries of dictd dictionary ``name`` in file order, each once (several headwords may
    share one), without the ``00-database-*`` metadata entries. Raises ``ValueError`` when
    entries overlap."""
    data = gzip.decompress(files[f"usr/share/dictd/{name}.dict.dz"]).decode(encoding)
    spans = set()
    for line in files[f"usr/share/dictd/{name}.index"].decode("utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if not headword.startswith("00"):
            spans.add((_b64_int(offset), _b64_int(length)))
    entries, end = [], 0
    for offset, length in sorted(spans):
        if offset < end:
            raise ValueError(f"{name}: dictd entry at {offset} overlaps the one before")
        entries.append(data[offset:offset + length])
        end = offset + length
    return entries


def _b64_int(digits: str) -> int:
    """The integer that dictd writes as ``digits`` in its base-64 alphabet."""
    value = 0
    for digit in digits:
        value = value * 64 + _B64.index(digit)
    return value


_GCIDE_SOURCE = re.compile(  # with what follows on its line (at times the next headword)
    r"\[[^\[\]]*\b(?:Webster|WordNet|PJC|RDH|RHUD|MI11)\b[^\[\]]*\][^\n]*")
_GCIDE_PRONUNCIATION = re.compile(r"\\[^\\]*\\|\([^()]*\*[^()]*\)|\([^()\s]*[`\"][^()\s]*\)")
_GCIDE_HEAD_PARENTHESIS = re.compile(r"^([^(\n]*?)\s*\([^()\n]*\)(?=,)")  # Jack (jăk), n.
_GCIDE_SYLLABLES = re.compile(r"(?<=[a-zA-Z])[*`\"]+(?=[a-zA-Z])|(?<=[a-zA-Z])`")
_GCIDE_ETYMOLOGY = re.compile(  # and inflections: [imp. & p. p. ...], [F. abaissé.], [L., fr. ...]
    r"\[(?:imp\.|pl\.|p\. p\.|superl\.|compar\.|[^\[\]]*\b(?:fr|[Cc]f)\."
    r"|(?:(?:[A-Z][a-zA-Z]*\.|&)[,;]? ?)+['a-z?\u00c0-\u024f])[^\[\]]*\]")
_GCIDE_MARKS = {"'": "\u0301", "`": "\u0300", "^": "\u0302", '"': "\u0308", "~": "\u0303",
                ",": "\u0327", "=": "\u0304", "-": "\u0304", ".": "\u0307"}
_GCIDE_NAMED = {"ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "deg": "°", "sect": "§",
                "eth": "ð", "thorn": "þ", "root": "√", "ng": "ŋ", "yogh": "ȝ", "pounds": "£",
                "imac": "ī", "aum": "ä", "asl": "a", "add": "a", "=oo": "oo", "oo^": "oo",
                "=ae": "æ", "frac12": "½", "frac14": "¼", "th": "th", "times": "×",
                **dict(zip("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu "
                           "xi omicron pi rho sigma tau upsilon phi chi psi omega".split(),
                           "αβγδεζηθικλμνξοπρστυφχψω"))}
_GCIDE_CODE = re.compile(
    r"\[(?:([a-zA-Z])\^|(['`^\"~,=.-])([a-zA-Z])|([a-zA-Z]{2,6}\d*|=oo|oo\^|=ae))\]")


def _gcide_char(m: re.Match) -> str:
    """The character that a GCIDE bracket code such as ``['e]`` or ``[ae]`` stands for; an
    unknown word-like code (a usage label like ``[Obs]``) is left as it is."""
    breve, mark, letter, named = m.groups()
    if breve:
        return unicodedata.normalize("NFC", breve + "\u0306")
    if mark:
        return unicodedata.normalize("NFC", letter + _GCIDE_MARKS[mark])
    return _GCIDE_NAMED.get(named, m.group(0))


def _gcide_entry(entry: str) -> str:
    """One GCIDE entry as plain text: headwords without pronunciations or syllable marks,
    etymologies, inflections, source tags (``[1913 Webster]``) and cross-reference braces
    dropped, accent codes made Unicode; usage labels (``[Obs.]``) kept."""
    entry = _GCIDE_PRONUNCIATION.sub("", _GCIDE_SOURCE.sub("", entry))
    entry = _GCIDE_HEAD_PARENTHESIS.sub(r"\1", entry)
    entry = _GCIDE_CODE.sub(_gcide_char, entry.replace("{", "").replace("}", ""))
    text = _paragraphs(_GCIDE_SYLLABLES.sub("", _GCIDE_ETYMOLOGY.sub("", entry)))
    return re.sub(r" +([,;.])", r"\1", text)


def _gcide(files: Mapping[str, bytes], per_doc: int = 150) -> Iterator[tuple[str, str]]:
    """GCIDE as documents ``gcide/<n>`` of ``per_doc`` consecutive entries (the dictionary is
    ASCII but for three Windows-1252 quotes)."""
    entries = [_gcide_entry(e) for e in _dictd_entries(files, "gcide", "cp1252")]
    for n in range(0, len(entries), per_doc):
        yield f"gcide/{n // per_doc:04d}", "\n\n".join(e for e in entries[n:n + per_doc] if e)


# --- SWORD zText / zCom modules: per testament, <x>zs (block index), <x>zz (zlib blocks) and
# <x>zv (entry index: block, offset, size); entries in versification order, OSIS markup.


@dataclass(frozen=True)
class _SwordModule:
    prefix: str  # of the doc_ids
    data_path: str  # in the .deb
    block_kind: str  # "b" (a block per book) or "c" (per chapter): the index files' letter
    entry_bytes: int  # 10 (uint16 sizes, zText/zCom) or 12 (uint32 sizes, zText4/zCom4)


def _sword_entries(files: Mapping[str, bytes], module: _SwordModule) -> Iterator[str]:
    """The OSIS markup of each entry of ``module``, Old then New Testament, in index order,
    each once (a commentary links the verses of one comment to the same entry). Raises
    ``ValueError`` when an index does not fit the blocks."""
    size_format = "<IIH" if module.entry_bytes == 10 else "<III"
    for testament in ("ot", "nt"):
        stem = f"{module.data_path}/{testament}.{module.block_kind}z"
        blocks_index, entries_index = files[stem + "s"], files[stem + "v"]
        if not blocks_index:
            continue
        if len(blocks_index) % 12 or len(entries_index) % module.entry_bytes:
            raise ValueError(f"{stem}: index sizes do not fit the module's entry format")
        blocks = [struct.unpack_from("<III", blocks_index, i)
                  for i in range(0, len(blocks_index), 12)]
        compressed = files[stem + "z"]
        loaded, text = -1, b""  # the last block decompressed
        seen: set[tuple[int, int, int]] = set()
        for i in range(0, len(entries_index), module.entry_bytes):
            key = struct.unpack_from(size_format, entries_index, i)
            block, offset, size = key
            if size == 0 or key in seen:
                continue
            seen.add(key)
            if block != loaded:
                if block >= len(blocks):
                    raise ValueError(f"{stem}: entry {i // module.entry_bytes} names no block")
                start, length, raw_length = blocks[block]
                loaded, text = block, zlib.decompress(compressed[start:start + length])
                if len(text) != raw_length:
                    raise ValueError(f"{stem}: block {block} is not {raw_length} bytes")
            if offset + size > len(text):
                raise ValueError(f"{stem}: entry {i // module.entry_bytes} is out of its block")
            yield text[offset:offset + size].decode("utf-8")


_OSIS_BOUNDARY = re.compile(r'<chapter\b[^>]*\bsID="[^"]*"[^>]*>|<div\b[^>]*\btype="book"[^>]*>')
_OSIS_CHAPTER_ID = re.compile(r'\bosisID="([^"]+)"')
_OSIS_RULES = [  # (pattern, replacement), in order
    (re.compile(r"<note\b[^>]*/>|<note\b.*?</note>", re.S), " "),  # footnotes, cross-references
    (re.compile(r'<div\b[^>]*type="x-milestone"[^>]*>'), ""),  # pre-verse markers
    (re.compile(r"</?(?:title|div|p|lg|list|table|head)\b[^>]*>"), "\n\n"),
    (re.compile(r"<(?:l|lb|item|row)\b(?![^>]*\beID=)[^>]*>"), "\n"),  # line starts, not ends
    (re.compile(r"<cell\b[^>]*>"), " "),
    (re.compile(r"<[^>]*(?:>|$)"), ""),  # other tags (and one cut short: web Dan.6)
]


def _osis_text(markup: str) -> str:
    """Plain text of OSIS ``markup``: notes dropped, titles, divisions and poetry lines kept as
    paragraphs and lines, every other tag dropped with its content kept."""
    for pattern, replacement in _OSIS_RULES:
        markup = pattern.sub(replacement, markup)
    text = _paragraphs(html.unescape(markup), keep_lines=True)
    return re.sub(r" ([,.;:!?’”)])", r"\1", text)


def _sword(module: _SwordModule, files: Mapping[str, bytes]) -> Iterator[tuple[str, str]]:
    """The chapters of a SWORD module as documents ``<prefix>/<osisID>`` (``web/Gen.1``); what
    precedes a book's first chapter (its title and introduction) opens that chapter. Raises
    ``ValueError`` when a chapter comes back after another one."""
    doc_id: str | None = None
    pending: list[str] = []  # before the next chapter
    current: list[str] = []
    seen: set[str] = set()
    for markup in _sword_entries(files, module):
        pos = 0
        for m in _OSIS_BOUNDARY.finditer(markup):
            (current if doc_id else pending).append(markup[pos:m.start()])
            pos = m.end()
            if m.group(0).startswith("<div"):
                if doc_id:
                    yield f"{module.prefix}/{doc_id}", _osis_text(" ".join(current))
                doc_id, current = None, []
                continue
            new_id = _OSIS_CHAPTER_ID.search(m.group(0)).group(1)
            if new_id == doc_id:  # a chapter marker repeated
                continue
            if doc_id:
                yield f"{module.prefix}/{doc_id}", _osis_text(" ".join(current))
            if new_id in seen:
                raise ValueError(f"{module.prefix}: {new_id} comes back after other chapters")
            doc_id, current, pending = new_id, pending, []
            seen.add(doc_id)
        (current if doc_id else pending).append(markup[pos:])
    if doc_id:
        yield f"{module.prefix}/{doc_id}", _osis_text(" ".join(current + pending))


# --- An Anarchist FAQ: one markdown file per section, cut at its "## " questions

_ANARCHISM_DIR = "usr/share/doc/anarchism/markdown/"
_ANARCHISM_PROSE = re.compile(
    r"(sec[A-J]\d*(?:int)?|append\d+(?:int)?|intro|vol[12]intro|10years)\.md")
_MARKDOWN_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_MARKDOWN_RULES = [  # (pattern, replacement), in order
    (re.compile(r"!\[[^\]]*\]\([^)]*\)"), ""),  # images
    (_MARKDOWN_LINK, r"\1"),  # links: their text
    (re.compile(r"^ *(?:#+|>+|[*+-](?= )) ?", re.M), ""),  # headings, quotes, bullets
    (re.compile(r"^ *(?:-{3,}|\*{3,}) *$", re.M), ""),  # rules
    (re.compile(r"\*\*|(?<!\w)_(?=\S)|(?<=\S)_(?!\w)"), ""),  # bold and italic marks
    (re.compile(r"\\([\\`*_{}\[\]()#+.!-])"), r"\1"),  # escapes
    (re.compile(r"\[ +"), "["),
    (re.compile(r" +([,.;:\]])"), r"\1"),
]


def _markdown_text(markdown: str) -> str:
    """Plain text of ``markdown``: marks, link targets and images dropped, paragraphs kept but
    those mostly of links (contents lists, page navigation)."""
    paras = []
    for para in re.split(r"\n\s*\n", markdown):
        if sum(len(m.group(0)) for m in _MARKDOWN_LINK.finditer(para)) * 2 < len(para):
            for pattern, replacement in _MARKDOWN_RULES:
                para = pattern.sub(replacement, para)
            paras.append(para)
    return _paragraphs("\n\n".join(paras))


def _anarchism(files: Mapping[str, bytes]) -> Iterator[tuple[str, str]]:
    """The FAQ's prose sections (not its contents pages, link lists or bibliography) as
    documents ``anarchism/<file>.<n>``: the text before a file's first ``## `` question, then
    each question that has an answer."""
    sections = {}
    for path, data in files.items():
        if path.startswith(_ANARCHISM_DIR):
            name = path[len(_ANARCHISM_DIR):].removesuffix(".gz")
            if _ANARCHISM_PROSE.fullmatch(name):
                sections[name] = gzip.decompress(data) if path.endswith(".gz") else data
    for name in sorted(sections):
        parts = re.split(r"^(?=## )", sections[name].decode("utf-8"), flags=re.M)
        for n, part in enumerate(parts):
            text = _markdown_text(part)
            if "\n\n" in text:  # more than a heading
                yield f"anarchism/{name.removesuffix('.md')}.{n:02d}", text


# --- janeaustenr: R lazy-load database data/Rdata.rdb (+ .rdx, the index): one character
# vector of lines per novel, serialized in R's XDR format and zlib-compressed

_AUSTEN_CHAPTER = re.compile(r"^\s*chapter\s+[0-9ivxlc]+\.?\s*$", re.I)


def _austen(files: Mapping[str, bytes]) -> Iterator[tuple[str, str]]:
    """Each chapter of the six novels as ``austen/<novel>/<n>`` (chapters counted through the
    volumes); title pages and volume headings dropped. Raises ``ValueError`` for objects other
    than character vectors, or a compression other than zlib."""
    lib = "usr/lib/R/site-library/janeaustenr/data/"
    index = _r_unserialize(gzip.decompress(files[lib + "Rdata.rdx"]))
    rdb = files[lib + "Rdata.rdb"]
    for novel, (offset, length) in index["variables"].items():
        chunk = rdb[offset:offset + length]
        raw_length = struct.unpack(">I", chunk[:4])[0]
        serialized = zlib.decompress(chunk[4:])
        if len(serialized) != raw_length:
            raise ValueError(f"janeaustenr: {novel} is not zlib data of {raw_length} bytes")
        lines = _r_unserialize(serialized)
        if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
            raise ValueError(f"janeaustenr: {novel} is not a character vector")
        chapters: list[list[str]] = []
        for line in lines:
            if _AUSTEN_CHAPTER.match(line):
                chapters.append([])
            elif chapters and not re.fullmatch(r"\s*(?:VOLUME|Volume) [IVX]+\s*|THE END", line):
                chapters[-1].append(line)
        for n, chapter in enumerate(chapters, 1):
            yield f"austen/{novel}/{n:02d}", _paragraphs("\n".join(chapter))


def _r_unserialize(data: bytes) -> object:
    """The object serialized in R's XDR format (``X\\n``, versions 2 and 3) as Python values:
    a character, integer or logical vector or a list as a ``list`` (a ``dict`` when it has
    names), a string as ``str``, NA and NULL as None. Raises ``ValueError`` for other formats
    and types (environments, closures, doubles...)."""
    if not data.startswith(b"X\n"):
        raise ValueError("not R serialization in XDR format")
    pos = 2

    def i32() -> int:
        nonlocal pos
        pos += 4
        return struct.unpack_from(">i", data, pos - 4)[0]

    version = i32()
    pos += 8  # the writer's and the oldest reader's R versions
    if version == 3:
        pos += i32() + 4  # the native encoding's name
    refs: list[object] = []

    def item() -> object:
        nonlocal pos
        flags = i32()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP
            return refs[(flags >> 8 or i32()) - 1]
        if kind == 1:  # SYMSXP
            refs.append(item())
            return refs[-1]
        if kind == 9:  # CHARSXP
            n = i32()
            if n == -1:
                return None
            pos += n
            return data[pos - n:pos].decode("latin-1" if flags & (1 << 14) else "utf-8")
        if kind == 2:  # LISTSXP: attributes, tag, head, tail
            pairs = []
            while kind == 2:
                if has_attr:
                    item()
                tag = item() if has_tag else None
                pairs.append((tag, item()))
                flags = i32()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
            if kind != 254:
                raise ValueError(f"R pairlist ends in type {kind}")
            return pairs
        if kind in (10, 13):  # LGLSXP, INTSXP
            n = i32()
            values: list[object] = list(struct.unpack_from(f">{n}i", data, pos))
            pos += 4 * n
        elif kind in (16, 19):  # STRSXP, VECSXP
            values = [item() for _ in range(i32())]
        else:
            raise ValueError(f"R type {kind} is not supported")
        if has_attr:
            names = dict(item()).get("names")
            if names is not None:
                return dict(zip(names, values))
        return values

    return item()


_EXTRACTORS: dict[str, Callable[[Mapping[str, bytes]], Iterator[tuple[str, str]]]] = {
    "dict-gcide": _gcide,
    "anarchism": _anarchism,
    "sword-comm-tdavid": partial(_sword, _SwordModule(
        "tdavid", "usr/share/sword/modules/comments/zcom/tdavid", "c", 12)),
    "sword-comm-mhcc": partial(_sword, _SwordModule(
        "mhcc", "usr/share/sword/modules/comments/zcom/mhcc", "b", 10)),
    "sword-text-web": partial(_sword, _SwordModule(
        "web", "usr/share/sword/modules/texts/ztext/engWEB2015eb", "b", 10)),
    "r-cran-janeaustenr": _austen,
}


def main(argv: list[str] | None = None) -> int:
    """Download every package into the cache directory and print what each holds; 0 on
    success, 1 (with the error on stderr) when a package cannot be fetched or read."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", help="where the .deb files are kept")
    parser.add_argument("--packages", nargs="+", choices=sorted(PACKAGES), default=list(PACKAGES),
                        help="only these packages")
    args = parser.parse_args(argv)
    started = time.monotonic()
    print(f"{'package':22} {'deb MB':>7} {'licence':17} {'docs':>6} {'text MB':>8} {'words':>11}"
          "  sha256")
    totals = [0, 0, 0]
    for name in args.packages:
        try:
            path = fetch(name, args.cache_dir)
            counts = [0, 0, 0]
            for _, text in documents(name, args.cache_dir):
                counts[0] += 1
                counts[1] += len(text)
                counts[2] += len(text.split())
        except (FetchError, ValueError) as e:
            print(e, file=sys.stderr)
            return 1
        totals = [t + c for t, c in zip(totals, counts)]
        pkg = PACKAGES[name]
        print(f"{name:22} {path.stat().st_size / 1e6:7.2f} {pkg.license:17} {counts[0]:6d} "
              f"{counts[1] / 1e6:8.2f} {counts[2]:11,d}  {pkg.sha256}")
    print(f"{'total':22} {'':7} {'':17} {totals[0]:6d} {totals[1] / 1e6:8.2f} {totals[2]:11,d}  "
          f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
