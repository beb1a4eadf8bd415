"""Build the tiny git repositories behind the shipped ``swe`` tasks, and ``swe.jsonl``.

Each repository is a small Python package with one bug and a pytest suite. For every spec below
the script commits the buggy base (fixed author and dates, so commit ids are identical on every
machine), derives the gold ``patch`` (the fix) and the hidden ``test_patch`` (new tests) with
``git diff``, checks that the FAIL_TO_PASS tests fail before the fix and everything passes after
it, and writes ``runtime/envs/data/swe_repos/<name>.bundle`` plus ``runtime/envs/data/swe.jsonl``.

    .venv/bin/python scripts/build_swe_repos.py           # rebuild
    .venv/bin/python scripts/build_swe_repos.py --check   # verify the shipped data
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from rollout.runtime.envs.grading.pytest_log import (
    PASSING,
    files_of,
    outcome_of,
    parse_pytest_report,
)
from rollout.runtime.envs.swe import runners as swe_runners

DATA_DIR = Path(__file__).resolve().parent.parent / "runtime" / "envs" / "data"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "Rollout Service", "GIT_AUTHOR_EMAIL": "rollout@example.invalid",
    "GIT_COMMITTER_NAME": "Rollout Service", "GIT_COMMITTER_EMAIL": "rollout@example.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "TZ": "UTC",
}
_DATES = ("2025-01-06T10:00:00+00:00", "2025-01-07T11:30:00+00:00")

_PYPROJECT = """[project]
name = "{name}"
version = "0.1.0"
requires-python = ">=3.9"
"""

SPECS: list[dict[str, Any]] = [
    {
        "name": "textstats",
        "problem_statement": (
            "`word_count` miscounts text with repeated whitespace\n\n"
            "`textstats.word_count(\"hello   world\")` returns 4 instead of 2, and text with "
            "newlines or tabs between words is miscounted as well. Words are maximal runs of "
            "non-whitespace characters; an empty or blank string has 0 words."),
        "files": {
            "textstats/__init__.py": "from textstats.core import char_count, word_count\n\n"
                                     "__all__ = [\"char_count\", \"word_count\"]\n",
            "textstats/core.py": (
                '"""Counting helpers for plain text."""\n\n\n'
                "def word_count(text):\n"
                '    """Number of whitespace-separated words in ``text``."""\n'
                "    if text == \"\":\n"
                "        return 0\n"
                "    return len(text.split(\" \"))\n\n\n"
                "def char_count(text, include_spaces=True):\n"
                '    """Number of characters, optionally ignoring whitespace."""\n'
                "    if include_spaces:\n"
                "        return len(text)\n"
                "    return sum(1 for c in text if not c.isspace())\n"),
            "tests/test_core.py": (
                "from textstats import char_count, word_count\n\n\n"
                "def test_simple_sentence():\n"
                "    assert word_count(\"the quick brown fox\") == 4\n\n\n"
                "def test_empty():\n"
                "    assert word_count(\"\") == 0\n\n\n"
                "def test_char_count():\n"
                "    assert char_count(\"a b\") == 3\n"
                "    assert char_count(\"a b\", include_spaces=False) == 2\n"),
        },
        "fix": {
            "textstats/core.py": (
                '"""Counting helpers for plain text."""\n\n\n'
                "def word_count(text):\n"
                '    """Number of whitespace-separated words in ``text``."""\n'
                "    return len(text.split())\n\n\n"
                "def char_count(text, include_spaces=True):\n"
                '    """Number of characters, optionally ignoring whitespace."""\n'
                "    if include_spaces:\n"
                "        return len(text)\n"
                "    return sum(1 for c in text if not c.isspace())\n"),
        },
        "tests_after": {
            "tests/test_core.py": (
                "from textstats import char_count, word_count\n\n\n"
                "def test_simple_sentence():\n"
                "    assert word_count(\"the quick brown fox\") == 4\n\n\n"
                "def test_empty():\n"
                "    assert word_count(\"\") == 0\n\n\n"
                "def test_char_count():\n"
                "    assert char_count(\"a b\") == 3\n"
                "    assert char_count(\"a b\", include_spaces=False) == 2\n\n\n"
                "def test_repeated_spaces():\n"
                "    assert word_count(\"hello   world\") == 2\n\n\n"
                "def test_newlines_and_tabs():\n"
                "    assert word_count(\"one\\ttwo\\nthree \\n\") == 3\n\n\n"
                "def test_blank():\n"
                "    assert word_count(\"   \") == 0\n"),
        },
        "fail_to_pass": ["tests/test_core.py::test_repeated_spaces",
                         "tests/test_core.py::test_newlines_and_tabs",
                         "tests/test_core.py::test_blank"],
        "pass_to_pass": ["tests/test_core.py::test_simple_sentence",
                         "tests/test_core.py::test_empty",
                         "tests/test_core.py::test_char_count"],
    },
    {
        "name": "intervals",
        "problem_statement": (
            "`merge` leaves touching intervals apart\n\n"
            "`intervals.merge([(1, 3), (3, 5)])` returns `[(1, 3), (3, 5)]`, but closed "
            "intervals that share an endpoint overlap and must be merged into `[(1, 5)]`."),
        "files": {
            "intervals/__init__.py": "from intervals.merge import merge, total_length\n\n"
                                     "__all__ = [\"merge\", \"total_length\"]\n",
            "intervals/merge.py": (
                '"""Operations on closed integer intervals given as (start, end) tuples."""\n\n\n'
                "def merge(intervals):\n"
                '    """Merge overlapping intervals; the result is sorted by start."""\n'
                "    result = []\n"
                "    for start, end in sorted(intervals):\n"
                "        if result and start < result[-1][1]:\n"
                "            last_start, last_end = result[-1]\n"
                "            result[-1] = (last_start, max(last_end, end))\n"
                "        else:\n"
                "            result.append((start, end))\n"
                "    return result\n\n\n"
                "def total_length(intervals):\n"
                '    """Length of the union of the intervals."""\n'
                "    return sum(end - start for start, end in merge(intervals))\n"),
            "tests/test_merge.py": (
                "from intervals import merge, total_length\n\n\n"
                "def test_disjoint():\n"
                "    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]\n\n\n"
                "def test_overlapping():\n"
                "    assert merge([(1, 4), (2, 6), (8, 9)]) == [(1, 6), (8, 9)]\n\n\n"
                "def test_total_length_disjoint():\n"
                "    assert total_length([(0, 1), (2, 4)]) == 3\n"),
        },
        "fix": {
            "intervals/merge.py": (
                '"""Operations on closed integer intervals given as (start, end) tuples."""\n\n\n'
                "def merge(intervals):\n"
                '    """Merge overlapping intervals; the result is sorted by start."""\n'
                "    result = []\n"
                "    for start, end in sorted(intervals):\n"
                "        if result and start <= result[-1][1]:\n"
                "            last_start, last_end = result[-1]\n"
                "            result[-1] = (last_start, max(last_end, end))\n"
                "        else:\n"
                "            result.append((start, end))\n"
                "    return result\n\n\n"
                "def total_length(intervals):\n"
                '    """Length of the union of the intervals."""\n'
                "    return sum(end - start for start, end in merge(intervals))\n"),
        },
        "tests_after": {
            "tests/test_merge.py": (
                "from intervals import merge, total_length\n\n\n"
                "def test_disjoint():\n"
                "    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]\n\n\n"
                "def test_overlapping():\n"
                "    assert merge([(1, 4), (2, 6), (8, 9)]) == [(1, 6), (8, 9)]\n\n\n"
                "def test_total_length_disjoint():\n"
                "    assert total_length([(0, 1), (2, 4)]) == 3\n\n\n"
                "def test_touching():\n"
                "    assert merge([(3, 5), (1, 3)]) == [(1, 5)]\n\n\n"
                "def test_chain_of_touching():\n"
                "    assert merge([(1, 2), (2, 3), (3, 4)]) == [(1, 4)]\n"),
        },
        "fail_to_pass": ["tests/test_merge.py::test_touching",
                         "tests/test_merge.py::test_chain_of_touching"],
        "pass_to_pass": ["tests/test_merge.py::test_disjoint",
                         "tests/test_merge.py::test_overlapping",
                         "tests/test_merge.py::test_total_length_disjoint"],
    },
    {
        "name": "minicsv",
        "problem_statement": (
            "`parse_line` splits inside quoted fields\n\n"
            "`minicsv.parse_line('a,\"b,c\",d')` returns `['a', '\"b', 'c\"', 'd']`. A field "
            "wrapped in double quotes may contain commas and must come back without its "
            "quotes: `['a', 'b,c', 'd']`. A doubled quote inside a quoted field (`\"\"`) "
            "stands for one literal quote character."),
        "files": {
            "minicsv/__init__.py": "from minicsv.parser import parse, parse_line\n\n"
                                   "__all__ = [\"parse\", \"parse_line\"]\n",
            "minicsv/parser.py": (
                '"""A minimal CSV reader."""\n\n\n'
                "def parse_line(line):\n"
                '    """Split one CSV record into its fields."""\n'
                "    return line.split(\",\")\n\n\n"
                "def parse(text):\n"
                '    """All records of ``text``, skipping blank lines."""\n'
                "    return [parse_line(line) for line in text.splitlines() if line.strip()]\n"),
            "tests/test_parser.py": (
                "from minicsv import parse, parse_line\n\n\n"
                "def test_plain_fields():\n"
                "    assert parse_line(\"a,b,c\") == [\"a\", \"b\", \"c\"]\n\n\n"
                "def test_empty_fields():\n"
                "    assert parse_line(\"a,,c\") == [\"a\", \"\", \"c\"]\n\n\n"
                "def test_parse_skips_blank_lines():\n"
                "    assert parse(\"x,y\\n\\n1,2\\n\") == [[\"x\", \"y\"], [\"1\", \"2\"]]\n"),
        },
        "fix": {
            "minicsv/parser.py": (
                '"""A minimal CSV reader."""\n\n\n'
                "def parse_line(line):\n"
                '    """Split one CSV record into its fields."""\n'
                "    fields, current, quoted, i = [], [], False, 0\n"
                "    while i < len(line):\n"
                "        ch = line[i]\n"
                "        if quoted:\n"
                "            if ch == '\"' and line[i + 1:i + 2] == '\"':\n"
                "                current.append('\"')\n"
                "                i += 1\n"
                "            elif ch == '\"':\n"
                "                quoted = False\n"
                "            else:\n"
                "                current.append(ch)\n"
                "        elif ch == '\"':\n"
                "            quoted = True\n"
                "        elif ch == \",\":\n"
                "            fields.append(\"\".join(current))\n"
                "            current = []\n"
                "        else:\n"
                "            current.append(ch)\n"
                "        i += 1\n"
                "    fields.append(\"\".join(current))\n"
                "    return fields\n\n\n"
                "def parse(text):\n"
                '    """All records of ``text``, skipping blank lines."""\n'
                "    return [parse_line(line) for line in text.splitlines() if line.strip()]\n"),
        },
        "tests_after": {
            "tests/test_parser.py": (
                "from minicsv import parse, parse_line\n\n\n"
                "def test_plain_fields():\n"
                "    assert parse_line(\"a,b,c\") == [\"a\", \"b\", \"c\"]\n\n\n"
                "def test_empty_fields():\n"
                "    assert parse_line(\"a,,c\") == [\"a\", \"\", \"c\"]\n\n\n"
                "def test_parse_skips_blank_lines():\n"
                "    assert parse(\"x,y\\n\\n1,2\\n\") == [[\"x\", \"y\"], [\"1\", \"2\"]]\n\n\n"
                "def test_quoted_comma():\n"
                "    assert parse_line('a,\"b,c\",d') == [\"a\", \"b,c\", \"d\"]\n\n\n"
                "def test_escaped_quote():\n"
                "    assert parse_line('\"say \"\"hi\"\"\",x') == ['say \"hi\"', \"x\"]\n"),
        },
        "fail_to_pass": ["tests/test_parser.py::test_quoted_comma",
                         "tests/test_parser.py::test_escaped_quote"],
        "pass_to_pass": ["tests/test_parser.py::test_plain_fields",
                         "tests/test_parser.py::test_empty_fields",
                         "tests/test_parser.py::test_parse_skips_blank_lines"],
    },
    {
        "name": "lrucache",
        "problem_statement": (
            "`LRUCache.get` does not count as a use\n\n"
            "With capacity 2: `put('a', 1); put('b', 2); get('a'); put('c', 3)` evicts `'a'`, "
            "although `'b'` is the least recently used key. Reading a key with `get` must make "
            "it the most recently used one."),
        "files": {
            "lrucache/__init__.py": "from lrucache.cache import LRUCache\n\n"
                                    "__all__ = [\"LRUCache\"]\n",
            "lrucache/cache.py": (
                '"""A least-recently-used cache with a fixed capacity."""\n\n'
                "from collections import OrderedDict\n\n\n"
                "class LRUCache:\n"
                "    def __init__(self, capacity):\n"
                "        if capacity <= 0:\n"
                "            raise ValueError(\"capacity must be positive\")\n"
                "        self.capacity = capacity\n"
                "        self._data = OrderedDict()\n\n"
                "    def get(self, key, default=None):\n"
                "        if key not in self._data:\n"
                "            return default\n"
                "        return self._data[key]\n\n"
                "    def put(self, key, value):\n"
                "        if key in self._data:\n"
                "            self._data.move_to_end(key)\n"
                "        self._data[key] = value\n"
                "        if len(self._data) > self.capacity:\n"
                "            self._data.popitem(last=False)\n\n"
                "    def __len__(self):\n"
                "        return len(self._data)\n\n"
                "    def __contains__(self, key):\n"
                "        return key in self._data\n"),
            "tests/test_cache.py": (
                "import pytest\n\n"
                "from lrucache import LRUCache\n\n\n"
                "def test_put_and_get():\n"
                "    cache = LRUCache(2)\n"
                "    cache.put(\"a\", 1)\n"
                "    assert cache.get(\"a\") == 1\n"
                "    assert cache.get(\"missing\", 0) == 0\n\n\n"
                "def test_evicts_oldest_put():\n"
                "    cache = LRUCache(2)\n"
                "    for key in \"abc\":\n"
                "        cache.put(key, key)\n"
                "    assert \"a\" not in cache and len(cache) == 2\n\n\n"
                "def test_rejects_zero_capacity():\n"
                "    with pytest.raises(ValueError):\n"
                "        LRUCache(0)\n"),
        },
        "fix": {
            "lrucache/cache.py": (
                '"""A least-recently-used cache with a fixed capacity."""\n\n'
                "from collections import OrderedDict\n\n\n"
                "class LRUCache:\n"
                "    def __init__(self, capacity):\n"
                "        if capacity <= 0:\n"
                "            raise ValueError(\"capacity must be positive\")\n"
                "        self.capacity = capacity\n"
                "        self._data = OrderedDict()\n\n"
                "    def get(self, key, default=None):\n"
                "        if key not in self._data:\n"
                "            return default\n"
                "        self._data.move_to_end(key)\n"
                "        return self._data[key]\n\n"
                "    def put(self, key, value):\n"
                "        if key in self._data:\n"
                "            self._data.move_to_end(key)\n"
                "        self._data[key] = value\n"
                "        if len(self._data) > self.capacity:\n"
                "            self._data.popitem(last=False)\n\n"
                "    def __len__(self):\n"
                "        return len(self._data)\n\n"
                "    def __contains__(self, key):\n"
                "        return key in self._data\n"),
        },
        "tests_after": {
            "tests/test_cache.py": (
                "import pytest\n\n"
                "from lrucache import LRUCache\n\n\n"
                "def test_put_and_get():\n"
                "    cache = LRUCache(2)\n"
                "    cache.put(\"a\", 1)\n"
                "    assert cache.get(\"a\") == 1\n"
                "    assert cache.get(\"missing\", 0) == 0\n\n\n"
                "def test_evicts_oldest_put():\n"
                "    cache = LRUCache(2)\n"
                "    for key in \"abc\":\n"
                "        cache.put(key, key)\n"
                "    assert \"a\" not in cache and len(cache) == 2\n\n\n"
                "def test_rejects_zero_capacity():\n"
                "    with pytest.raises(ValueError):\n"
                "        LRUCache(0)\n\n\n"
                "def test_get_refreshes_recency():\n"
                "    cache = LRUCache(2)\n"
                "    cache.put(\"a\", 1)\n"
                "    cache.put(\"b\", 2)\n"
                "    assert cache.get(\"a\") == 1\n"
                "    cache.put(\"c\", 3)\n"
                "    assert \"a\" in cache and \"b\" not in cache\n"),
        },
        "fail_to_pass": ["tests/test_cache.py::test_get_refreshes_recency"],
        "pass_to_pass": ["tests/test_cache.py::test_put_and_get",
                         "tests/test_cache.py::test_evicts_oldest_put",
                         "tests/test_cache.py::test_rejects_zero_capacity"],
    },
    {
        "name": "semver",
        "problem_statement": (
            "`compare` orders versions as strings\n\n"
            "`semver.compare(\"1.10.0\", \"1.9.0\")` returns -1, so 1.10.0 sorts before 1.9.0. "
            "Versions must compare numerically, component by component (major, minor, patch); "
            "`compare` returns -1, 0 or 1 and `max_version` picks the highest version."),
        "files": {
            "semver/__init__.py": "from semver.version import compare, max_version, parse\n\n"
                                  "__all__ = [\"compare\", \"max_version\", \"parse\"]\n",
            "semver/version.py": (
                '"""Parsing and ordering of MAJOR.MINOR.PATCH version strings."""\n\n'
                "import functools\n\n\n"
                "def parse(version):\n"
                '    """The three components of ``version`` as strings."""\n'
                "    parts = version.strip().split(\".\")\n"
                "    if len(parts) != 3 or not all(p.isdigit() for p in parts):\n"
                "        raise ValueError(f\"not a MAJOR.MINOR.PATCH version: {version!r}\")\n"
                "    return tuple(parts)\n\n\n"
                "def compare(a, b):\n"
                '    """-1, 0 or 1 as ``a`` is lower than, equal to or higher than ``b``."""\n'
                "    pa, pb = parse(a), parse(b)\n"
                "    return (pa > pb) - (pa < pb)\n\n\n"
                "def max_version(versions):\n"
                "    return max(versions, key=functools.cmp_to_key(compare))\n"),
            "tests/test_version.py": (
                "import pytest\n\n"
                "from semver import compare, max_version, parse\n\n\n"
                "def test_equal():\n"
                "    assert compare(\"1.2.3\", \"1.2.3\") == 0\n\n\n"
                "def test_single_digit_order():\n"
                "    assert compare(\"1.2.3\", \"1.3.0\") == -1\n"
                "    assert compare(\"2.0.0\", \"1.9.9\") == 1\n\n\n"
                "def test_parse_rejects_garbage():\n"
                "    with pytest.raises(ValueError):\n"
                "        parse(\"1.2\")\n"),
        },
        "fix": {
            "semver/version.py": (
                '"""Parsing and ordering of MAJOR.MINOR.PATCH version strings."""\n\n'
                "import functools\n\n\n"
                "def parse(version):\n"
                '    """The three components of ``version`` as integers."""\n'
                "    parts = version.strip().split(\".\")\n"
                "    if len(parts) != 3 or not all(p.isdigit() for p in parts):\n"
                "        raise ValueError(f\"not a MAJOR.MINOR.PATCH version: {version!r}\")\n"
                "    return tuple(int(p) for p in parts)\n\n\n"
                "def compare(a, b):\n"
                '    """-1, 0 or 1 as ``a`` is lower than, equal to or higher than ``b``."""\n'
                "    pa, pb = parse(a), parse(b)\n"
                "    return (pa > pb) - (pa < pb)\n\n\n"
                "def max_version(versions):\n"
                "    return max(versions, key=functools.cmp_to_key(compare))\n"),
        },
        "tests_after": {
            "tests/test_version.py": (
                "import pytest\n\n"
                "from semver import compare, max_version, parse\n\n\n"
                "def test_equal():\n"
                "    assert compare(\"1.2.3\", \"1.2.3\") == 0\n\n\n"
                "def test_single_digit_order():\n"
                "    assert compare(\"1.2.3\", \"1.3.0\") == -1\n"
                "    assert compare(\"2.0.0\", \"1.9.9\") == 1\n\n\n"
                "def test_parse_rejects_garbage():\n"
                "    with pytest.raises(ValueError):\n"
                "        parse(\"1.2\")\n\n\n"
                "def test_multi_digit_components():\n"
                "    assert compare(\"1.10.0\", \"1.9.0\") == 1\n"
                "    assert compare(\"0.0.9\", \"0.0.10\") == -1\n\n\n"
                "def test_max_version():\n"
                "    assert max_version([\"1.9.0\", \"1.10.0\", \"1.2.11\"]) == \"1.10.0\"\n"),
        },
        "fail_to_pass": ["tests/test_version.py::test_multi_digit_components",
                         "tests/test_version.py::test_max_version"],
        "pass_to_pass": ["tests/test_version.py::test_equal",
                         "tests/test_version.py::test_single_digit_order",
                         "tests/test_version.py::test_parse_rejects_garbage"],
    },
]

# Tasks that need a per-task environment (the task's "spec"): a src/ layout that only an
# install makes importable, a dependency that exists only in the wheelhouse, a package whose
# name collides with one in the server's venv, pytest configuration the run depends on, and
# class-based test ids.
_TASK_PYTEST = "pytest==8.3.5"

_MDURL_DECODE = (
    '"""Percent-decoding of URL strings."""\n\n'
    "_HEX = \"0123456789abcdefABCDEF\"\n\n\n"
    "def decode(text):\n"
    '    """Replace every %XX escape in ``text`` with the byte it encodes (UTF-8)."""\n'
    "    raw = text.encode(\"utf-8\")\n"
    "    out = bytearray()\n"
    "    i = 0\n"
    "    while i < len(raw):\n"
    "        chunk = raw[i:i + 3]\n"
    "        if (chunk[:1] == b\"%\" and i + 3 < len(raw)\n"
    "                and all(chr(c) in _HEX for c in chunk[1:])):\n"
    "            out.append(int(chunk[1:], 16))\n"
    "            i += 3\n"
    "        else:\n"
    "            out.append(raw[i])\n"
    "            i += 1\n"
    "    return out.decode(\"utf-8\", \"replace\")\n")
_MDURL_TESTS = (
    "import pytest\n\n"
    "import mdurl\n\n\n"
    "@pytest.mark.encoding\n"
    "class DescribeDecode:\n"
    "    def test_plain(self):\n"
    "        assert mdurl.decode(\"abc\") == \"abc\"\n\n"
    "    def test_escape_in_middle(self):\n"
    "        assert mdurl.decode(\"a%20b\") == \"a b\"\n"
    "{extra_decode}\n\n"
    "@pytest.mark.encoding\n"
    "class DescribeEncode:\n"
    "    def test_space(self):\n"
    "        assert mdurl.encode(\"a b\") == \"a%20b\"\n")
_MDURL_NEW_TESTS = (
    "\n"
    "    def test_escape_at_end(self):\n"
    "        assert mdurl.decode(\"a%20\") == \"a \"\n\n"
    "    def test_multibyte_at_end(self):\n"
    "        assert mdurl.decode(\"caf%C3%A9\") == \"caf\\u00e9\"\n")
_TINYUNITS = {
    "tinyunits/__init__.py": (
        '"""Length units and their size in metres."""\n\n'
        "FACTORS = {\"mm\": 0.001, \"cm\": 0.01, \"m\": 1.0, \"km\": 1000.0, "
        "\"in\": 0.0254, \"ft\": 0.3048}\n\n\n"
        "def factor(unit):\n"
        "    try:\n"
        "        return FACTORS[unit]\n"
        "    except KeyError:\n"
        "        raise ValueError(f\"unknown unit: {unit!r}\") from None\n"),
}
_UNITCONV = (
    '"""Converting lengths between units."""\n\n'
    "from tinyunits import factor\n\n\n"
    "def convert(value, from_unit, to_unit):\n"
    '    """``value`` in ``from_unit``, expressed in ``to_unit``."""\n'
    "    return value * {ratio}\n")
_UNITCONV_TESTS = (
    "import pytest\n\n"
    "from unitconv import convert\n\n\n"
    "class TestConvert:\n"
    "    def test_same_unit(self):\n"
    "        assert convert(5, \"m\", \"m\") == 5\n\n"
    "    def test_unknown_unit(self):\n"
    "        with pytest.raises(ValueError):\n"
    "            convert(1, \"m\", \"furlong\")\n"
    "{extra}")
_UNITCONV_NEW_TESTS = (
    "\n"
    "    def test_km_to_m(self):\n"
    "        assert convert(1, \"km\", \"m\") == pytest.approx(1000)\n\n"
    "    def test_inches_to_feet(self):\n"
    "        assert convert(12, \"in\", \"ft\") == pytest.approx(1)\n")

SPECS += [
    {
        "name": "mdurl",
        "version": "0.3",
        "problem_statement": (
            "`decode` leaves an escape at the end of the string alone\n\n"
            "`mdurl.decode(\"a%20\")` returns `\"a%20\"` instead of `\"a \"`, and "
            "`mdurl.decode(\"caf%C3%A9\")` returns `\"caf\\ufffd%A9\"` instead of "
            "`\"caf\\u00e9\"`: a percent escape that ends the string is never decoded."),
        "files": {
            "pyproject.toml": (
                "[build-system]\nrequires = [\"setuptools>=64\"]\n"
                "build-backend = \"setuptools.build_meta\"\n\n"
                "[project]\nname = \"mdurl\"\nversion = \"0.3.0\"\n"
                "requires-python = \">=3.9\"\n\n"
                "[tool.setuptools.packages.find]\nwhere = [\"src\"]\n\n"
                "[tool.pytest.ini_options]\ntestpaths = [\"tests\"]\n"
                "python_classes = [\"Describe*\"]\naddopts = \"--strict-markers\"\n"
                "markers = [\"encoding: percent-encoding and decoding\"]\n"),
            "src/mdurl/__init__.py": ("from mdurl._decode import decode\n"
                                      "from mdurl._encode import encode\n\n"
                                      "__all__ = [\"decode\", \"encode\"]\n"),
            "src/mdurl/_decode.py": _MDURL_DECODE,
            "src/mdurl/_encode.py": (
                '"""Percent-encoding of URL strings."""\n\n'
                "_SAFE = frozenset(b\"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                "0123456789-_.~/:\")\n\n\n"
                "def encode(text):\n"
                '    """Escape every byte of ``text`` (UTF-8) outside the safe set."""\n'
                "    return \"\".join(chr(b) if b in _SAFE else f\"%{b:02X}\"\n"
                "                   for b in text.encode(\"utf-8\"))\n"),
            "tests/test_mdurl.py": _MDURL_TESTS.format(extra_decode=""),
        },
        "fix": {"src/mdurl/_decode.py": _MDURL_DECODE.replace("i + 3 < len(raw)",
                                                              "i + 3 <= len(raw)")},
        "tests_after": {"tests/test_mdurl.py": _MDURL_TESTS.format(
            extra_decode=_MDURL_NEW_TESTS)},
        "fail_to_pass": ["tests/test_mdurl.py::DescribeDecode::test_escape_at_end",
                         "tests/test_mdurl.py::DescribeDecode::test_multibyte_at_end"],
        "pass_to_pass": ["tests/test_mdurl.py::DescribeDecode::test_plain",
                         "tests/test_mdurl.py::DescribeDecode::test_escape_in_middle",
                         "tests/test_mdurl.py::DescribeEncode::test_space"],
        "spec": {"python": f"{sys.version_info.major}.{sys.version_info.minor}",
                 "pip_packages": [_TASK_PYTEST, "wheel==0.45.1"],
                 "install": "python -m pip install --no-build-isolation --no-deps -e ."},
        "verify_path": ["src"],
    },
    {
        "name": "unitconv",
        "version": "1.0",
        "problem_statement": (
            "`convert` turns kilometres into millimetres\n\n"
            "`unitconv.convert(1, \"km\", \"m\")` returns 0.001 instead of 1000: every "
            "conversion between different units comes out inverted."),
        "files": {
            "pyproject.toml": ("[project]\nname = \"unitconv\"\nversion = \"1.0.0\"\n"
                               "requires-python = \">=3.9\"\n"
                               "dependencies = [\"tinyunits==0.1.0\"]\n"),
            "setup.cfg": ("[tool:pytest]\ntestpaths = checks\npython_files = check_*.py\n"),
            "unitconv/__init__.py": "from unitconv.core import convert\n\n"
                                    "__all__ = [\"convert\"]\n",
            "unitconv/core.py": _UNITCONV.format(
                ratio="factor(to_unit) / factor(from_unit)"),
            "checks/check_convert.py": _UNITCONV_TESTS.format(extra=""),
        },
        "fix": {"unitconv/core.py": _UNITCONV.format(
            ratio="factor(from_unit) / factor(to_unit)")},
        "tests_after": {"checks/check_convert.py": _UNITCONV_TESTS.format(
            extra=_UNITCONV_NEW_TESTS)},
        "fail_to_pass": ["checks/check_convert.py::TestConvert::test_km_to_m",
                         "checks/check_convert.py::TestConvert::test_inches_to_feet"],
        "pass_to_pass": ["checks/check_convert.py::TestConvert::test_same_unit",
                         "checks/check_convert.py::TestConvert::test_unknown_unit"],
        "spec": {"pip_packages": [_TASK_PYTEST, "tinyunits==0.1.0"]},
        "verify_path": ["@tinyunits-0.1.0-py3-none-any.whl"],
    },
]

# Repositories with their own test runner, in the output formats of the real ones, so the
# shipped tasks exercise the grader's Django-style and SymPy-style paths without those
# projects (runtime.envs.swe.runners). Their FAIL_TO_PASS/PASS_TO_PASS name tests the way
# SWE-bench's lists for django/django and sympy/sympy do.
_DJ_RUNTESTS = (
    "#!/usr/bin/env python\n"
    '"""Run the test suite, the way Django\'s tests/runtests.py does: labels are test modules\n'
    'relative to this folder (``text_tests.tests``); nothing given runs every app."""\n'
    "import argparse\n"
    "import os\n"
    "import sys\n"
    "import unittest\n\n"
    "RUNTESTS_DIR = os.path.abspath(os.path.dirname(__file__))\n"
    "sys.path[:0] = [os.path.dirname(RUNTESTS_DIR), RUNTESTS_DIR]\n\n\n"
    "def main():\n"
    "    parser = argparse.ArgumentParser(description=\"Run the tinydj test suite.\")\n"
    "    parser.add_argument(\"modules\", nargs=\"*\", metavar=\"module\")\n"
    "    parser.add_argument(\"-v\", \"--verbosity\", type=int, default=1)\n"
    "    parser.add_argument(\"--parallel\", default=\"1\")\n"
    "    parser.add_argument(\"--settings\")\n"
    "    args = parser.parse_args()\n"
    "    import tinydj\n"
    "    print(\"Testing against tinydj installed in '%s'\" % os.path.dirname(tinydj.__file__))\n"
    "    loader = unittest.defaultTestLoader\n"
    "    if args.modules:\n"
    "        suite = loader.loadTestsFromNames(args.modules)\n"
    "    else:\n"
    "        suite = loader.discover(RUNTESTS_DIR, pattern=\"tests.py\", "
    "top_level_dir=RUNTESTS_DIR)\n"
    "    result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)\n"
    "    sys.exit(bool(result.failures or result.errors))\n\n\n"
    "if __name__ == \"__main__\":\n"
    "    main()\n")
_DJ_TEXT = (
    '"""Text helpers for URLs."""\n\n'
    "import re\n"
    "import unicodedata\n\n\n"
    "def slugify(value):\n"
    '    """Lowercase ASCII words of ``value`` joined by single hyphens."""\n'
    "    value = unicodedata.normalize(\"NFKD\", str(value))\n"
    "    value = value.encode(\"ascii\", \"ignore\").decode(\"ascii\")\n"
    "    value = re.sub(r\"[^\\w\\s-]\", \"\", value.lower())\n"
    "    return {ret}\n")
_DJ_TESTS = (
    "from unittest import TestCase\n\n"
    "from tinydj.text import slugify\n\n\n"
    "class SlugifyTests(TestCase):\n"
    "    def test_words(self):\n"
    "        self.assertEqual(slugify(\"Hello World\"), \"hello-world\")\n\n"
    "    def test_punctuation(self):\n"
    "        self.assertEqual(slugify(\"a.b, c!\"), \"ab-c\")\n\n"
    "    def test_accents(self):\n"
    "        self.assertEqual(slugify(\"Caf\\u00e9\"), \"cafe\")\n"
    "{extra}")
_DJ_NEW_TESTS = (
    "\n"
    "    def test_repeated_spaces_and_hyphens(self):\n"
    "        self.assertEqual(slugify(\"a  --  b\"), \"a-b\")\n\n"
    "    def test_surrounding_separators(self):\n"
    "        self.assertEqual(slugify(\" -hello- \"), \"hello\")\n")
_SYM_RUNTESTS = (
    '"""A test runner in the manner of SymPy\'s: ``bin/test [-C] [--verbose] [PATH ...]``\n'
    "runs the ``test_*`` functions of the given test files (default: every\n"
    "``tinysym/**/tests/test_*.py``) and reports like ``sympy.testing.runtests``.\"\"\"\n\n"
    "import glob\n"
    "import importlib\n"
    "import os\n"
    "import sys\n"
    "import time\n"
    "import traceback\n\n"
    "WIDTH = 80\n\n\n"
    "def _report(name, mark, dot, verbose):\n"
    "    if verbose:\n"
    "        print(\"%s %s\" % (name, mark))\n"
    "    else:\n"
    "        print(dot, end=\"\")\n\n\n"
    "def _module_of(path):\n"
    "    return os.path.splitext(os.path.normpath(path))[0].replace(os.sep, \".\")\n\n\n"
    "def test(*paths, verbose=False):\n"
    "    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n"
    "    os.chdir(root)\n"
    "    files = list(paths) or sorted(glob.glob(\"tinysym/**/tests/test_*.py\", "
    "recursive=True))\n"
    "    print(\" test process starts \".center(WIDTH, \"=\"))\n"
    "    print(\"executable:         %s  (%s) [CPython]\" % (sys.executable, "
    "sys.version.split()[0]))\n"
    "    print(\"cache:              no\")\n"
    "    print()\n"
    "    started, passed, failures = time.time(), 0, []\n"
    "    for path in files:\n"
    "        module = importlib.import_module(_module_of(path))\n"
    "        tests = [(n, f) for n, f in vars(module).items()\n"
    "                 if n.startswith(\"test_\") and callable(f)]\n"
    "        print(\"%s[%d] \" % (path, len(tests)))\n"
    "        for name, func in tests:\n"
    "            try:\n"
    "                func()\n"
    "            except AssertionError:\n"
    "                failures.append((path, name, \"F\", traceback.format_exc()))\n"
    "                _report(name, \"F\", \"F\", verbose)\n"
    "            except Exception:\n"
    "                failures.append((path, name, \"E\", traceback.format_exc()))\n"
    "                _report(name, \"E\", \"E\", verbose)\n"
    "            else:\n"
    "                passed += 1\n"
    "                _report(name, \"ok\", \".\", verbose)\n"
    "        print()\n"
    "    for path, name, _, text in failures:\n"
    "        print()\n"
    "        print(\"_\" * WIDTH)\n"
    "        print((\" %s:%s \" % (path, name)).center(WIDTH, \"_\"))\n"
    "        print(text, end=\"\")\n"
    "    failed = sum(1 for f in failures if f[2] == \"F\")\n"
    "    errors = len(failures) - failed\n"
    "    summary = \" tests finished: %d passed, \" % passed\n"
    "    if failed:\n"
    "        summary += \"%d failed, \" % failed\n"
    "    if errors:\n"
    "        summary += \"%d exceptions, \" % errors\n"
    "    summary += \"in %.2f seconds \" % (time.time() - started)\n"
    "    print(summary.center(WIDTH, \"=\"))\n"
    "    if failures:\n"
    "        print(\"DO *NOT* COMMIT!\")\n"
    "    return not failures\n")
_SYM_BIN_TEST = (
    "#!/usr/bin/env python\n"
    '"""Program to execute doctests and unit tests for tinysym, like SymPy\'s bin/test."""\n'
    "import os\n"
    "import sys\n\n"
    "sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n\n"
    "from tinysym.testing.runtests import test  # noqa: E402\n\n"
    "args = [a for a in sys.argv[1:] if not a.startswith(\"-\")]\n"
    "ok = test(*args, verbose=\"--verbose\" in sys.argv or \"-v\" in sys.argv)\n"
    "sys.exit(0 if ok else 1)\n")
_SYM_CORE = (
    '"""Elementary functions on integers and rationals."""\n\n'
    "from fractions import Fraction\n\n\n"
    "def sign(x):\n"
    '    """-1, 0 or 1, the sign of ``x``."""\n'
    "    {sign}\n\n\n"
    "def absolute(x):\n"
    "    return x * sign(x)\n\n\n"
    "def rational(p, q=1):\n"
    "    return Fraction(p, q)\n")
_SYM_TESTS = (
    "from tinysym.core import absolute, rational, sign\n"
    "from tinysym.testing.pytest import raises\n\n\n"
    "def test_sign_positive():\n"
    "    assert sign(3) == 1\n"
    "    assert sign(rational(1, 2)) == 1\n\n\n"
    "def test_sign_negative():\n"
    "    assert sign(-2) == -1\n\n\n"
    "def test_rational_zero_denominator():\n"
    "    raises(ZeroDivisionError, lambda: rational(1, 0))\n"
    "{extra}")
_SYM_NEW_TESTS = (
    "\n\n"
    "def test_sign_zero():\n"
    "    assert sign(0) == 0\n"
    "    assert sign(rational(0, 5)) == 0\n\n\n"
    "def test_absolute_zero():\n"
    "    assert absolute(0) == 0\n"
    "    assert absolute(-3) == 3\n")

SPECS += [
    {
        "name": "tinydj",
        "test_runner": "django",
        "problem_statement": (
            "`slugify` keeps runs of separators\n\n"
            "`tinydj.text.slugify(\"a  --  b\")` returns `\"a------b\"` instead of `\"a-b\"`, "
            "and `slugify(\" -hello- \")` returns `\"--hello--\"`: runs of spaces and hyphens "
            "must become one hyphen, and none may lead or trail. Run the tests with "
            "`python tests/runtests.py text_tests`."),
        "files": {
            "tinydj/__init__.py": "\"\"\"A tiny web toolkit.\"\"\"\n\n__version__ = \"0.1\"\n",
            "tinydj/text.py": _DJ_TEXT.format(ret="value.replace(\" \", \"-\")"),
            "tests/runtests.py": _DJ_RUNTESTS,
            "tests/text_tests/__init__.py": "",
            "tests/text_tests/tests.py": _DJ_TESTS.format(extra=""),
        },
        "fix": {"tinydj/text.py": _DJ_TEXT.format(
            ret="re.sub(r\"[-\\s]+\", \"-\", value).strip(\"-_\")")},
        "tests_after": {"tests/text_tests/tests.py": _DJ_TESTS.format(extra=_DJ_NEW_TESTS)},
        "fail_to_pass": [
            "test_repeated_spaces_and_hyphens (text_tests.tests.SlugifyTests)",
            "test_surrounding_separators (text_tests.tests.SlugifyTests)"],
        "pass_to_pass": ["test_words (text_tests.tests.SlugifyTests)",
                         "test_punctuation (text_tests.tests.SlugifyTests)",
                         "test_accents (text_tests.tests.SlugifyTests)"],
    },
    {
        "name": "tinysym",
        "test_runner": "sympy",
        "problem_statement": (
            "`sign(0)` is -1\n\n"
            "`tinysym.core.sign(0)` returns -1, and so `absolute(0)` is 0 only by luck while "
            "`sign(Fraction(0, 5))` is -1 as well: the sign of zero is 0. Run the tests with "
            "`bin/test tinysym/tests/test_core.py`."),
        "files": {
            "tinysym/__init__.py": "\"\"\"A tiny algebra package.\"\"\"\n",
            "tinysym/core.py": _SYM_CORE.format(sign="return 1 if x > 0 else -1"),
            "tinysym/testing/__init__.py": "",
            "tinysym/testing/pytest.py": (
                '"""Test helpers that need no pytest (as sympy.testing.pytest)."""\n\n\n'
                "def raises(expected, code):\n"
                "    try:\n"
                "        code()\n"
                "    except expected:\n"
                "        return\n"
                "    raise AssertionError(\"DID NOT RAISE\")\n"),
            "tinysym/testing/runtests.py": _SYM_RUNTESTS,
            "bin/test": _SYM_BIN_TEST,
            "tinysym/tests/__init__.py": "",
            "tinysym/tests/test_core.py": _SYM_TESTS.format(extra=""),
        },
        "fix": {"tinysym/core.py": _SYM_CORE.format(
            sign="return (x > 0) - (x < 0)")},
        "tests_after": {"tinysym/tests/test_core.py": _SYM_TESTS.format(
            extra=_SYM_NEW_TESTS)},
        "fail_to_pass": ["test_sign_zero"],
        "pass_to_pass": ["test_sign_positive", "test_sign_negative",
                         "test_rational_zero_denominator", "test_absolute_zero"],
    },
]

for _spec in SPECS:
    _spec["files"].setdefault("pyproject.toml", _PYPROJECT.format(name=_spec["name"]))
    _spec["files"]["README.md"] = f"# {_spec['name']}\n\nA tiny library. Run `python -m pytest`.\n"


def _git(repo: Path, *args: str, date: str = _DATES[0]) -> str:
    env = {**os.environ, **_GIT_ENV, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    return subprocess.run(["git", "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false",
                           "-c", "pack.threads=1", *args], cwd=repo, env=env, check=True,
                          capture_output=True, text=True).stdout


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _diff(repo: Path, files: dict[str, str]) -> str:
    """The patch that turns the checked-out tree into one with ``files`` written."""
    _write(repo, files)
    patch = _git(repo, "diff", "--no-color", "--no-ext-diff")
    _git(repo, "checkout", "--", ".")
    return patch


def _outcomes(repo: Path, node_ids: list[str], path: list[str], runner: str = "pytest",
              test_files: list[str] | None = None) -> dict[str, bool]:
    """Pass/fail of each node id (trusted code: the summary of ``-rA`` is enough here; a
    runner of the repository's own is read by the grader's parser for its log).
    ``path`` goes first on PYTHONPATH: what the task's environment installs (a src/ folder,
    a dependency's wheel), so the repository's copy wins over anything in this venv."""
    # No bytecode: the checks run the same files before and after a patch, often within one
    # second and at the same size, and a cached .pyc of the other version would run instead.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join(path)}
    if runner != "pytest":
        spec = swe_runners.SPECS[runner]
        argv = swe_runners.command(spec, sys.executable, str(repo), None,
                                   swe_runners.directives(spec, test_files or []))
        run = subprocess.run(argv, cwd=repo, capture_output=True, text=True, env=env)
        log_outcomes, _ = swe_runners.parse_log(spec, run.stdout + run.stderr)
        return {node: log_outcomes.get(node) in PASSING for node in node_ids}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                           *files_of(node_ids)], cwd=repo, capture_output=True, text=True,
                          env=env)
    outcomes = parse_pytest_report(proc.stdout)
    return {node: outcome_of(node, outcomes) in PASSING for node in node_ids}


def _verify(repo: Path, spec: dict[str, Any], patch: str, test_patch: str,
            wheelhouse: Path) -> None:
    def apply(text: str) -> None:
        subprocess.run(["git", "apply", "-"], cwd=repo, input=text, text=True, check=True)

    path = [str(wheelhouse / p[1:]) if p.startswith("@") else str(repo / p)
            for p in spec.get("verify_path", [])]
    apply(test_patch)
    runner = spec.get("test_runner", "pytest")
    named = spec["fail_to_pass"] + spec["pass_to_pass"]
    before = _outcomes(repo, named, path, runner, list(spec["tests_after"]))
    apply(patch)
    after = _outcomes(repo, named, path, runner, list(spec["tests_after"]))
    _git(repo, "checkout", "--", ".")
    _git(repo, "clean", "-fdxq")
    bad = [n for n in spec["fail_to_pass"] if before[n]] + [n for n, ok in after.items() if not ok]
    bad += [n for n in spec["pass_to_pass"] if not before[n]]
    if bad:
        raise SystemExit(f"{spec['name']}: tests behave unexpectedly: {bad}")


def build_wheel(name: str, version: str, files: dict[str, str], out_dir: Path) -> Path:
    """A pure-Python wheel written byte for byte the same on every machine (fixed order and
    timestamps), for the shipped wheelhouse."""
    dist = f"{name}-{version}.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            f"{dist}/WHEEL": ("Wheel-Version: 1.0\nGenerator: build_swe_repos\n"
                              "Root-Is-Purelib: true\nTag: py3-none-any\n")}
    entries = {**files, **meta}
    record = []
    for rel, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{rel},sha256={digest.decode()},{len(text.encode())}")
    entries[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, text in entries.items():
            info = zipfile.ZipInfo(rel, date_time=(2025, 1, 6, 10, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, text)
    return wheel


def build_one(spec: dict[str, Any], out_dir: Path, wheelhouse: Path) -> dict[str, Any]:
    """Create one repository and its bundle; return its task (SWE-bench instance format)."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / spec["name"]
        repo.mkdir()
        _git(repo, "init", "-q", "-b", "main")
        sources = {k: v for k, v in spec["files"].items()
                   if not k.startswith("tests/") and k not in spec["tests_after"]}
        _write(repo, sources)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"Initial import of {spec['name']}", date=_DATES[0])
        _write(repo, spec["files"])
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", "Add tests", date=_DATES[1])
        base_commit = _git(repo, "rev-parse", "HEAD").strip()
        patch = _diff(repo, spec["fix"])
        test_patch = _diff(repo, spec["tests_after"])
        _verify(repo, spec, patch, test_patch, wheelhouse)
        out_dir.mkdir(parents=True, exist_ok=True)
        bundle = out_dir / f"{spec['name']}.bundle"
        _git(repo, "bundle", "create", "-q", str(bundle), "HEAD", "main")
    task = {
        "instance_id": f"rollout__{spec['name']}-1",
        "repo": f"rollout-service/{spec['name']}",
        "repo_source": f"swe_repos/{spec['name']}.bundle",
        "test_env": {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        "base_commit": base_commit,
        "problem_statement": spec["problem_statement"],
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": spec["fail_to_pass"],
        "PASS_TO_PASS": spec["pass_to_pass"],
    }
    if "test_runner" in spec:
        task["test_runner"] = spec["test_runner"]
    if "spec" in spec:
        task["version"] = spec["version"]
        task["spec"] = spec["spec"]
    return task


def build(data_dir: Path) -> list[dict[str, Any]]:
    wheelhouse = data_dir / "wheelhouse"
    build_wheel("tinyunits", "0.1.0", _TINYUNITS, wheelhouse)
    tasks = [build_one(spec, data_dir / "swe_repos", wheelhouse) for spec in SPECS]
    with open(data_dir / "swe.jsonl", "w") as f:
        for task in tasks:
            f.write(json.dumps({"environment": "swe", "task": task}) + "\n")
    return tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="rebuild into a temporary folder and compare with the shipped data")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    if not args.check:
        tasks = build(args.data_dir)
        print(f"wrote {len(tasks)} repositories and swe.jsonl under {args.data_dir}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        fresh = (Path(tmp) / "swe.jsonl").read_text()
        wheels = {p.name: p.read_bytes() for p in (Path(tmp) / "wheelhouse").iterdir()}
    if fresh != (args.data_dir / "swe.jsonl").read_text():
        print("swe.jsonl is stale: run scripts/build_swe_repos.py", file=sys.stderr)
        return 1
    shipped = args.data_dir / "wheelhouse"
    if any(not (shipped / n).is_file() or (shipped / n).read_bytes() != b
           for n, b in wheels.items()):
        print("the shipped wheelhouse is stale: run scripts/build_swe_repos.py",
              file=sys.stderr)
        return 1
    print("swe.jsonl matches a fresh build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
