"""Pronunciation lexicons: literal words or phrases, matched case-insensitively on word boundaries, replaced by a
respelling before the text reaches the model.

Clients never send a pattern: the matcher is a trie of the literal terms with Aho-Corasick's links, run once over the
text (its cost per character: docs/benchmarks.md, "Text work per input"). At a position the longest term wins, and
matching goes on after it (nothing overlaps; a replacement is never matched again). A term never matches part of a
word: where its first (last) character is a letter, digit or `_`, the character before (after) it must not be one.

Text that arrives in pieces is rewritten exactly as the whole text would be (`LexiconStream`): text that could still
be the start of a match, or a match whose following character has not arrived, is held back until it is decided
(at most `MAX_TERM_CHARS` characters); the end of the text (a flush, a mark, `context.end`) decides it.
"""
from __future__ import annotations

import asyncio
import gc
import re
import threading
import time
import unicodedata
import weakref
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

MAX_RULES = 1000  # per lexicon
MAX_TERM_CHARS = 100
MAX_REPLACEMENT_CHARS = 200  # a term's text grows at most this much (a 1-character term, 200 characters out)
MAX_LEXICON_CHARS = 50_000  # terms and replacements together
MAX_STORED_LEXICONS = 100
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SPACES = re.compile(r"\s+")
# characters that show nothing alone: format characters (ZWSP, joiners, bidi marks), controls, surrogates, unassigned
# code points, combining marks and separators; a term of these only would rewrite what nobody wrote
_UNSEEN = frozenset({"Cc", "Cf", "Cs", "Cn", "Mn", "Mc", "Me", "Zs", "Zl", "Zp"})
# client lexicons are compiled here, one at a time: pure Python holds the GIL, so each compile running beside the
# event loop takes a share of it; one at a time, the loop keeps at least half
LEXICON_COMPILER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxgate-lexicon")


class LexiconError(ValueError):
    """A lexicon refused (malformed, past a bound, a duplicate term) or a name not stored; the socket and the HTTP
    endpoints each turn it into their error code."""


@dataclass(frozen=True)
class Rule:
    term: str  # as given, surrounding whitespace stripped and inner runs of it made one space
    replacement: str


@dataclass(frozen=True)
class Swap:
    """A match: text[start:end] is spoken as `replacement`."""
    start: int
    end: int
    replacement: str


def _fold(ch: str) -> str:
    """One character for case-insensitive comparison, always one character long (so offsets never shift):
    its lower case where that is one character, a space for any whitespace."""
    if ch.isspace():
        return " "
    lower = ch.lower()
    return lower if len(lower) == 1 else ch


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


class _Trie:
    """The terms' trie with Aho-Corasick's links, as flat lists indexed by node (the root is 0): `next` (a node's
    children by folded character), `replacement` (of the term ending at the node, or None), `depth` (the length of
    the prefix it stands for), `fail` (the node of its longest proper suffix in the trie) and `output` (the longest
    term ending here, itself or down the fail chain; -1: none). Flat, it holds no reference cycle and nothing the
    garbage collector tracks but its five lists (a node's dict of characters to ints is untracked): a node object
    each, linked in cycles, made every collection walk millions of objects with the event loop stopped (a hostile
    try: 99 stored lexicons, pauses of 4.4 s, and 11.7 s for the collection a full bound forced)."""
    __slots__ = ("next", "replacement", "depth", "fail", "output", "__weakref__")

    def __init__(self) -> None:
        self.next: list[dict[str, int]] = []
        self.replacement: list[str | None] = []
        self.depth: list[int] = []
        self.fail: list[int] = []
        self.output: list[int] = []
        self.add(0)

    def add(self, depth: int) -> int:
        self.next.append({})
        self.replacement.append(None)
        self.depth.append(depth)
        self.fail.append(0)
        self.output.append(-1)
        return len(self.depth) - 1

    def __len__(self) -> int:
        return len(self.depth)

    def link(self) -> None:
        """Aho-Corasick's fail and output links, breadth first."""
        nxt, fail, output, replacement = self.next, self.fail, self.output, self.replacement
        queue = deque([0])
        while queue:
            node = queue.popleft()
            for ch, child in nxt[node].items():
                suffix = fail[node]
                while suffix and ch not in nxt[suffix]:
                    suffix = fail[suffix]
                fail[child] = nxt[suffix][ch] if node and ch in nxt[suffix] else 0
                output[child] = child if replacement[child] is not None else output[fail[child]]
                queue.append(child)


def _trie(rules: tuple[Rule, ...]) -> _Trie:
    trie = _Trie()
    for rule in rules:
        node = 0
        for ch in map(_fold, rule.term):
            child = trie.next[node].get(ch)
            if child is None:
                child = trie.next[node][ch] = trie.add(trie.depth[node] + 1)
            node = child
        trie.replacement[node] = rule.replacement
    trie.link()
    return trie


class Tries:
    """The compiled tries of every lexicon in use, shared: lexicons with the same rules (a client that sends its
    inline lexicon with each session or context) take one trie, built once. A trie node costs ~300 bytes and the
    largest lexicon allowed ~50,000 of them (~15 MB, ~0.15 s to build); `max_nodes` bounds the nodes of all the
    distinct tries alive at once, so that clients sending distinct inline lexicons cannot take the server's memory
    (a hostile try: 48 contexts with inline lexicons, +750 MB). Past it a new one is refused (`LexiconsBusy`) until
    others are released. A stored lexicon's trie is the store's, bounded by its capacity; once replaced or deleted
    (`unstore`) it counts like an inline one for as long as sessions still hold it (re-posting one name with new
    rules, each taken by sessions, went past the bound). The last `keep` tries stay built after their lexicons are
    gone."""

    def __init__(self, max_nodes: int, keep: int = 8) -> None:
        self.max_nodes, self.keep = max_nodes, keep
        self.nodes = 0  # of the distinct tries alive, and of those being built
        self._alive: weakref.WeakValueDictionary[tuple[Rule, ...], _Trie] = weakref.WeakValueDictionary()
        self._counts: dict[tuple[Rule, ...], _Count] = {}  # each trie alive: what it counts and its size
        self._recent: OrderedDict[tuple[Rule, ...], _Trie] = OrderedDict()
        # client lexicons compile on LEXICON_COMPILER, while the event loop's lexicons are released (a finalizer runs
        # where the last reference goes); reentrant: a collection inside `get` may run `_released` on the same thread
        self._lock = threading.RLock()
        self._collected_at = -COLLECT_INTERVAL_S

    def get(self, rules: tuple[Rule, ...], bounded: bool = True) -> _Trie:
        """The trie of `rules`, shared or built; `bounded`: it counts against `max_nodes` (an inline lexicon's; a
        stored one's is bounded by the store)."""
        with self._lock:
            trie = self._alive.get(rules)
            size = sum(len(rule.term) for rule in rules) + 1 if bounded else 0  # at most its nodes, known before
            if trie is None:
                self._reserve(size)
        if trie is None:  # built outside the lock: the other threads and the event loop go on meanwhile
            try:
                trie = _trie(rules)
            except BaseException:
                with self._lock:
                    self.nodes -= size
                raise
            with self._lock:  # the reservation becomes the count, in one step (another thread may have won)
                self.nodes -= size
                trie = self._alive.get(rules) or self._adopt(rules, trie, len(trie), bounded)
        with self._lock:
            self._recent[rules] = trie
            self._recent.move_to_end(rules)
            while len(self._recent) > self.keep:
                self._recent.popitem(last=False)
        return trie

    def _reserve(self, size: int) -> None:
        self._check_room(size)
        self.nodes += size

    def check_room(self, size: int) -> None:
        """Raises LexiconsBusy unless `size` more nodes fit the bound (after collecting released tries, if due)."""
        with self._lock:
            self._check_room(size)

    def _check_room(self, size: int) -> None:
        if self.nodes + size > self.max_nodes:
            self._recent.clear()  # what is kept only for reuse goes first; a trie has no cycle, but an ended
            if time.monotonic() - self._collected_at > COLLECT_INTERVAL_S:  # session's lexicon may wait in its
                self._collected_at = time.monotonic()  # cyclic garbage for the collector: run it under pressure,
                gc.collect()  # at most so often (tries add none of their nodes to its walk)
            if self.nodes + size > self.max_nodes:
                raise LexiconsBusy("the server holds as many distinct lexicons as it can (its sessions' and those "
                                   "replaced while in use); share one (a stored lexicon, the same rules) or retry "
                                   "when other sessions have ended")

    def _adopt(self, rules: tuple[Rule, ...], trie: _Trie, size: int, bounded: bool) -> _Trie:
        count = self._counts[rules] = _Count(size, size if bounded else 0)
        self.nodes += count.counted
        weakref.finalize(trie, self._released, rules, count)
        self._alive[rules] = trie
        return trie

    def uncounted(self, rules: tuple[Rule, ...]) -> int:
        """The nodes of the trie of `rules` that do not count against the bound (a stored lexicon's; 0 if none)."""
        with self._lock:
            count = self._counts.get(rules)
            return count.size - count.counted if count is not None else 0

    def unstore(self, rules: tuple[Rule, ...]) -> None:
        """Rules no stored lexicon has (any more): their trie, while alive, counts against `max_nodes` from now."""
        with self._lock:
            count = self._counts.get(rules)
            if count is not None and not count.counted:
                count.counted = count.size
                self.nodes += count.size

    def _released(self, rules: tuple[Rule, ...], count: _Count) -> None:
        with self._lock:
            self.nodes -= count.counted
            if self._counts.get(rules) is count:
                del self._counts[rules]


@dataclass
class _Count:
    size: int  # the trie's nodes
    counted: int  # of them, what counts against the bound (0 while the store holds it)


COLLECT_INTERVAL_S = 10.0
MAX_TRIE_NODES = 2_000_000  # ~600 MB: 40 of the largest lexicons, or 2,000 of 1,000 characters
TRIES = Tries(MAX_TRIE_NODES)


@dataclass(frozen=True, eq=False)
class Lexicon:
    rules: tuple[Rule, ...]
    name: str | None = None  # a stored lexicon's name; None: given inline
    _root: _Trie = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_root", TRIES.get(self.rules, bounded=self.name is None))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "rules": [{"term": r.term, "replacement": r.replacement} for r in self.rules]}

    def apply(self, text: str) -> str:
        """The whole text, rewritten."""
        swaps, _ = self.scan(text, "", final=True)
        return spoken(text, swaps)

    def scan(self, text: str, before: str, final: bool) -> tuple[list[Swap], int]:
        """The matches in `text` (`before`: the character preceding it, "" at the start) and how far the text is
        decided; past that, the next text could still change the result. With `final` all of it is.

        One Aho-Corasick pass finds the terms ending at each character, while a cursor settles the matches left to
        right: at the cursor the longest term that may start there, then on after it. Text before the cursor is
        dropped from the automaton's state, and terms starting inside the cursor's match are not looked at, so the
        cost stays near the text's length whatever the terms (a trie walked from every position cost up to
        `MAX_TERM_CHARS` steps a character: a hostile lexicon held the event loop for 0.3 s on 20,000 characters)."""
        word = [_is_word(ch) for ch in text]
        starts_word = [bool(before) and _is_word(before)] + word  # starts_word[i]: the character before i is one

        def inside_word(start: int) -> bool:  # no term starts here
            return starts_word[start] and word[start]

        swaps: list[Swap] = []
        cursor, at_cursor = 0, None  # matches before the cursor are settled; the longest term at it so far
        later: dict[int, tuple[int, str]] = {}  # start after the cursor -> (end, replacement) of its longest term

        def settle() -> None:
            nonlocal cursor, at_cursor
            if at_cursor is None:
                cursor += 1
            else:
                swaps.append(Swap(cursor, *at_cursor))
                cursor = at_cursor[0]
            at_cursor = later.pop(cursor, None)

        trie = self._root
        nxt, fail, output, depth, replacement = trie.next, trie.fail, trie.output, trie.depth, trie.replacement
        node = 0
        for end, ch in enumerate(map(_fold, text), 1):
            while node and ch not in nxt[node]:
                node = fail[node]
            node = nxt[node].get(ch, 0)
            # a term never ends inside a word (the same for every term ending here); at the text's end only the
            # final text decides
            found = output[node] if (not (word[end - 1] and word[end]) if end < len(text) else final) else -1
            while found >= 0:
                start = end - depth[found]  # from the longest term to the shortest: `start` grows
                if start == cursor:
                    if not inside_word(start):
                        at_cursor = (end, replacement[found])
                elif (at_cursor is None or start >= at_cursor[0]) and not inside_word(start):
                    later[start] = (end, replacement[found])  # ends only grow: the longest term at `start`
                if at_cursor is not None and at_cursor[0] >= end:
                    break  # the shorter ones start inside the cursor's match
                found = output[fail[found]]
            # the cursor is decided once no term from it can still be lengthened (or none starts there)
            while cursor < end and (end - cursor > depth[node] or inside_word(cursor)):
                settle()
            while depth[node] > end - cursor:  # text before the cursor matches nothing more
                node = fail[node]
        undecided = set() if final else {  # starts of a term the next text may still complete or lengthen
            len(text) - depth[open_] for open_ in _chain(trie, node) if not inside_word(len(text) - depth[open_])}
        while cursor < len(text):
            if cursor in undecided:
                return swaps, cursor
            settle()
        return swaps, len(text)


def _chain(trie: _Trie, node: int) -> list[int]:
    """The node and its fail chain, short of the root: every suffix of the text that is a prefix of a term."""
    chain = []
    while node:
        chain.append(node)
        node = trie.fail[node]
    return chain


def spoken(text: str, swaps: list[Swap]) -> str:
    out, at = [], 0
    for swap in swaps:
        out += [text[at:swap.start], swap.replacement]
        at = swap.end
    out.append(text[at:])
    return "".join(out)


class LexiconStream:
    """One context's text through a lexicon, piece by piece: `append` returns what is decided, `finish` the rest
    (the text's end). The concatenated output equals `Lexicon.apply` of the concatenated input."""

    def __init__(self, lexicon: Lexicon) -> None:
        self.lexicon = lexicon
        self._held = ""
        self._before = ""  # the last character released

    def append(self, text: str) -> str:
        return self._release(self._held + text, final=False)

    def finish(self) -> str:
        return self._release(self._held, final=True)

    def _release(self, text: str, final: bool) -> str:
        swaps, cut = self.lexicon.scan(text, self._before, final)
        self._held = text[cut:]
        if cut:
            self._before = text[cut - 1]
        return spoken(text[:cut], swaps)


# --- parsing a client's lexicon --------------------------------------------------------------------------------

def parse_rules(value: Any, name: str | None = None) -> Lexicon:
    """A lexicon from a client's rules, `[{"term": ..., "replacement": ...}, ...]`; raises LexiconError naming the
    first problem."""
    if not isinstance(value, list):
        raise LexiconError("a lexicon is a list of rules, each {\"term\": ..., \"replacement\": ...}")
    if not value:
        raise LexiconError("a lexicon needs at least one rule")
    if len(value) > MAX_RULES:
        raise LexiconError(f"a lexicon takes at most {MAX_RULES} rules, not {len(value)}")
    rules, seen, size = [], {}, 0
    for index, item in enumerate(value):
        rule = _rule(item, index)
        key = "".join(_fold(ch) for ch in rule.term)
        if key in seen:
            raise LexiconError(f"rule {index}: term {rule.term!r} repeats rule {seen[key]} (terms match "
                               "case-insensitively)")
        seen[key] = index
        size += len(rule.term) + len(rule.replacement)
        if size > MAX_LEXICON_CHARS:
            raise LexiconError(f"a lexicon's terms and replacements take at most {MAX_LEXICON_CHARS} characters")
        rules.append(rule)
    return Lexicon(tuple(rules), name)


def has_visible_character(text: str) -> bool:
    """Whether `text` shows anything: not only format characters (zero-width spaces, joiners), controls, marks or
    spaces."""
    return any(unicodedata.category(ch) not in _UNSEEN for ch in text)


def control_character(text: str) -> str | None:
    """The first control character in `text` other than a tab or a line end (CR, LF): NUL, escape, bell, form feed;
    stored text that is read back (a lexicon, a voice's transcript) holds none."""
    return next((ch for ch in text if unicodedata.category(ch) == "Cc" and ch not in "\t\n\r"), None)


def _rule(item: Any, index: int) -> Rule:
    if not isinstance(item, dict):
        raise LexiconError(f"rule {index} must be an object {{\"term\": ..., \"replacement\": ...}}")
    term, replacement = item.get("term"), item.get("replacement")
    if not isinstance(term, str) or not isinstance(replacement, str):
        raise LexiconError(f"rule {index}: term and replacement must both be strings")
    term = _SPACES.sub(" ", term.strip())
    if not term:
        raise LexiconError(f"rule {index}: the term is empty")
    if not has_visible_character(term):
        raise LexiconError(f"rule {index}: the term {term!r} has no visible character (only format characters, "
                           "controls or marks)")
    for name, text in (("term", term), ("replacement", replacement)):
        control = control_character(text)
        if control is not None:
            raise LexiconError(f"rule {index}: the {name} holds the control character U+{ord(control):04X}")
    if len(term) > MAX_TERM_CHARS:
        raise LexiconError(f"rule {index}: a term takes at most {MAX_TERM_CHARS} characters")
    if len(replacement) > MAX_REPLACEMENT_CHARS:
        raise LexiconError(f"rule {index}: a replacement takes at most {MAX_REPLACEMENT_CHARS} characters")
    return Rule(term, replacement)


def compiled(value: Any, name: str | None = None) -> Lexicon | LexiconError:
    """A client's rules as a lexicon, on the compiler thread ahead of the message or request that carries them; the
    refusal if they are refused, which its own handling raises (`LexiconStore.resolve`) with its error code."""
    try:
        return parse_rules(value, name)
    except LexiconError as failure:
        return failure


async def compile_off_loop(value: Any, name: str | None = None) -> Lexicon | LexiconError:
    """`compiled` on `LEXICON_COMPILER`: the largest lexicon takes ~0.2 s of Python, which on the event loop stalls
    every socket and request."""
    return await asyncio.get_running_loop().run_in_executor(LEXICON_COMPILER, compiled, value, name)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise LexiconError("a lexicon's name is 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or "
                           "digit")
    return name


class LexiconStore:
    """Named lexicons, in memory (they do not survive a restart), at most `capacity` of them. A session or request
    that names one takes it as it is then: replacing or deleting it later changes no running context."""

    def __init__(self, capacity: int = MAX_STORED_LEXICONS) -> None:
        self.capacity = capacity
        self._lexicons: OrderedDict[str, Lexicon] = OrderedDict()

    def put(self, name: Any, rules: Any) -> tuple[Lexicon, bool]:
        """Store (or replace) a lexicon; returns it and whether it is new. `rules`: a client's, or what `compiled`
        made of them under this name. Raises LexiconError, StoreFull or LexiconsBusy; a lexicon compiled for it and
        refused then counts against the bound on tries like any the store does not hold."""
        check_name(name)
        lexicon = self.resolve(rules) if isinstance(rules, Lexicon | LexiconError) else parse_rules(rules, name)
        if lexicon.name != name:
            raise ValueError(f"a lexicon compiled as {lexicon.name!r} stored as {name!r}")
        try:
            self.check_room(name)  # (again, for a compile off the loop: other requests may have stored meanwhile)
        except LexiconError:
            if self._leaves(lexicon):  # compiled for the store, and the store does not hold its rules
                TRIES.unstore(lexicon.rules)
            raise
        replaced = self._lexicons.get(name)
        self._lexicons[name] = lexicon
        if replaced is not None and self._leaves(replaced):
            TRIES.unstore(replaced.rules)
        return lexicon, replaced is None

    def check_room(self, name: Any) -> None:
        """Raises LexiconError for a bad name, StoreFull where storing `name` would pass the capacity, LexiconsBusy
        while tries that left the store fill the bound (sessions hold them): replacing or deleting a name again and
        again, each taken by sessions, would otherwise grow memory without end. Checked before a compile, and after."""
        if check_name(name) not in self._lexicons and len(self._lexicons) >= self.capacity:
            raise StoreFull(f"at most {self.capacity} lexicons are stored; delete one first")
        replaced = self._lexicons.get(name)
        TRIES.check_room(TRIES.uncounted(replaced.rules) if replaced is not None and self._leaves(replaced) else 0)

    def get(self, name: str) -> Lexicon:
        lexicon = self._lexicons.get(name)
        if lexicon is None:
            raise LexiconNotFound(f"no lexicon named {name[:64]!r}; POST /v1/lexicons stores one")
        return lexicon

    def delete(self, name: str) -> None:
        """Always done: the trie that leaves, if sessions hold it, may take the bound past full (storing waits)."""
        lexicon = self.get(name)
        del self._lexicons[name]
        if self._leaves(lexicon):
            TRIES.unstore(lexicon.rules)

    def _leaves(self, lexicon: Lexicon) -> bool:
        """No name but its own stores these rules: once it is replaced or deleted, its trie is not the store's."""
        return not any(other.rules == lexicon.rules for other in self._lexicons.values() if other is not lexicon)

    def names(self) -> list[str]:
        return list(self._lexicons)

    def resolve(self, value: Any) -> Lexicon:
        """A lexicon field of a session, context or request: a stored lexicon's name, or rules given inline (already
        compiled on a worker thread by `compiled`, or refused there, or not)."""
        if isinstance(value, Lexicon):
            return value
        if isinstance(value, LexiconError):  # inline rules already refused where they were compiled
            raise value
        if isinstance(value, str):
            return self.get(value)
        return parse_rules(value)


class LexiconNotFound(LexiconError):
    pass


class LexiconsBusy(LexiconError):
    """A new lexicon would pass the bound on the compiled lexicons alive (`Tries`): retry later."""


class StoreFull(LexiconError):
    pass
