"""Hand-written bugs with issue-style problem statements, one edit each.

`find` must occur exactly once in the module; replacing it with `replace` introduces the bug.
"""

from __future__ import annotations

import msgspec


class HandBug(msgspec.Struct, frozen=True, kw_only=True):
    """A bug we wrote by hand, with the issue a user would file about it."""

    library: str
    path: str
    find: str
    replace: str
    statement: str
    hints: str = ""


HAND_BUGS: tuple[HandBug, ...] = (
    HandBug(
        library="textkit",
        path="textkit/slug.py",
        find=(
            "        slug = slug[:max_length]\n"
            "        while slug.endswith(separator):\n"
            "            slug = slug[: -len(separator)]\n"
        ),
        replace="        slug = slug[:max_length]\n",
        statement=(
            "slugify(max_length=...) can return a slug that ends with a separator\n\n"
            '`slugify("hello big world", max_length=10)` returns `"hello-big-"`. The docstring '
            'says the slug never ends on a separator, so I expected `"hello-big"`.'
        ),
    ),
    HandBug(
        library="textkit",
        path="textkit/case.py",
        find="if index > 0 and (previous_lower or (next_lower and name[index - 1].isupper())):",
        replace="if index > 0 and previous_lower:",
        statement=(
            "camel_to_snake glues acronyms to the following word\n\n"
            '`camel_to_snake("HTTPServer")` gives `"httpserver"` and '
            '`camel_to_snake("getHTTPResponse")` gives `"get_httpresponse"`. Acronyms should '
            'stay together but be separated from the next word: `"http_server"`, '
            '`"get_http_response"`.'
        ),
    ),
    HandBug(
        library="numkit",
        path="numkit/stats.py",
        find="    return (ordered[middle - 1] + ordered[middle]) / 2\n",
        replace="    return ordered[middle]\n",
        statement=(
            "median() is wrong for an even number of values\n\n"
            "`median([4, 1, 3, 2])` returns 3. For an even count the median is the mean of the "
            "two middle values, 2.5."
        ),
    ),
    HandBug(
        library="numkit",
        path="numkit/stats.py",
        find=(
            "    best = values[0]\n"
            "    for value in values:\n"
            "        if counts[value] > counts[best]:\n"
            "            best = value\n"
            "    return best\n"
        ),
        replace="    return max(sorted(counts), key=counts.get)\n",
        statement=(
            "mode() breaks ties the wrong way\n\n"
            "`mode([5, 1, 1, 5])` returns 1, but the documentation says ties go to the value "
            "seen first, which is 5."
        ),
    ),
    HandBug(
        library="intervals",
        path="intervals/ops.py",
        find="        if merged and span.start <= merged[-1].end:\n",
        replace="        if merged and span.start < merged[-1].end:\n",
        statement=(
            "merge() does not join touching spans\n\n"
            "`merge([Span(0, 3), Span(3, 4)])` returns `[Span(0, 3), Span(3, 4)]`. The docstring "
            "promises that overlapping *or touching* spans are merged: expected `[Span(0, 4)]`."
        ),
    ),
    HandBug(
        library="intervals",
        path="intervals/ops.py",
        find="        pieces.append(Span(max(cut.end, span.start), span.end))\n",
        replace="        pieces.append(Span(cut.end, span.end))\n",
        statement=(
            "subtract() grows the span when the cut lies before it\n\n"
            "`subtract(Span(5, 8), Span(0, 2))` returns `[Span(2, 8)]`: points 2-4 were never in "
            "the span. Nothing should be removed here, so the answer is `[Span(5, 8)]`."
        ),
    ),
    HandBug(
        library="matrixkit",
        path="matrixkit/core.py",
        find="        sign = -1 if j % 2 else 1\n",
        replace="        sign = 1 if j % 2 else -1\n",
        statement=(
            "determinant() has the wrong sign for 3x3 and larger matrices\n\n"
            "`determinant([[6, 1, 1], [4, -2, 5], [2, 8, 7]])` returns 306; the right value is "
            "-306. 1x1 and 2x2 matrices are fine."
        ),
    ),
    HandBug(
        library="matrixkit",
        path="matrixkit/core.py",
        find="    return [[matrix[i][j] for i in range(rows)] for j in range(columns)]\n",
        replace="    return [[matrix[i][j] for i in range(rows)] for j in range(rows)]\n",
        statement=(
            "transpose() loses columns of non-square matrices\n\n"
            "`transpose([[1, 2, 3], [4, 5, 6]])` returns `[[1, 4], [2, 5]]` instead of "
            "`[[1, 4], [2, 5], [3, 6]]`."
        ),
    ),
    HandBug(
        library="datekit",
        path="datekit/calendar.py",
        find="    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        replace="    return year % 4 == 0 and year % 100 != 0\n",
        statement=(
            "is_leap(2000) is False\n\n"
            "Years divisible by 400 are leap years in the Gregorian calendar, so 2000 was one."
        ),
    ),
    HandBug(
        library="datekit",
        path="datekit/dates.py",
        find=(
            "    while day < 1:\n"
            "        month -= 1\n"
            "        if month < 1:\n"
            "            month = 12\n"
            "            year -= 1\n"
            "        day += days_in_month(year, month)\n"
        ),
        replace=(
            "    while day < 1:\n"
            "        day += days_in_month(year, month)\n"
            "        month -= 1\n"
            "        if month < 1:\n"
            "            month = 12\n"
            "            year -= 1\n"
        ),
        statement=(
            "add_days with a negative count produces impossible dates\n\n"
            "`add_days((2024, 3, 1), -1)` returns `(2024, 2, 31)`; it should be `(2024, 2, 29)`."
        ),
    ),
    HandBug(
        library="structkit",
        path="structkit/cache.py",
        find=("        value = self._data.pop(key)\n        self._data[key] = value\n        return value\n"),
        replace="        return self._data[key]\n",
        statement=(
            "LRUCache evicts keys that were just read\n\n"
            "After `put('a')`, `put('b')`, `get('a')`, `put('c')` on a cache of capacity 2 the "
            "keys are `['b', 'c']`: reading 'a' did not make it recently used."
        ),
    ),
    HandBug(
        library="structkit",
        path="structkit/ring.py",
        find="        return self._slots[(self._start + self._count - 1) % self.size]\n",
        replace="        return self._slots[self._count - 1]\n",
        statement=(
            "RingBuffer.latest() returns a stale item after wrapping around\n\n"
            "With `RingBuffer(2)` and appends 'a', 'b', 'c', `latest()` returns 'b'; the newest "
            "item is 'c'."
        ),
    ),
    HandBug(
        library="calc",
        path="calc/evaluator.py",
        find="            return base ** self.factor()\n",
        replace="            return base ** self.atom()\n",
        statement=(
            "Exponents reject unary minus and chained powers\n\n"
            "`evaluate('2 ^ -1')` raises `CalcError: unexpected '-'` (expected 0.5) and "
            "`evaluate('2 ^ 3 ^ 2')` fails with trailing input; `^` is right-associative, so "
            "that is 512."
        ),
    ),
    HandBug(
        library="calc",
        path="calc/evaluator.py",
        find=(
            "    try:\n"
            "        tokens = tokenize(text)\n"
            "    except ValueError as exc:\n"
            "        raise CalcError(str(exc)) from exc\n"
        ),
        replace="    tokens = tokenize(text)\n",
        statement=(
            "evaluate() leaks a plain ValueError for bad characters\n\n"
            "`evaluate('1 & 2')` raises ValueError from the tokenizer. Every malformed "
            "expression should raise CalcError, as documented."
        ),
    ),
    HandBug(
        library="codec",
        path="codec/roman.py",
        find="        if index + 1 < len(text) and VALUES[text[index + 1]] > value:\n",
        replace="        if index + 1 < len(text) and VALUES[text[index + 1]] >= value:\n",
        statement=(
            "from_roman miscounts repeated numerals\n\n"
            "`from_roman('III')` returns -1 and `from_roman('XX')` returns 0. Only a smaller "
            "numeral before a larger one is subtracted."
        ),
    ),
    HandBug(
        library="codec",
        path="codec/text.py",
        find="            count += char\n",
        replace="            count = char\n",
        statement=(
            "rle_decode ignores all but the last digit of a count\n\n"
            "`rle_decode('12z')` gives 'zz' instead of twelve 'z's."
        ),
    ),
)
