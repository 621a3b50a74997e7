"""Sanitizer reports read out of a spawned server's output: what an instrumented upstream build says went wrong.

A release build survives most memory corruption silently; a build with AddressSanitizer and UBSan (``ggml-rpc
upstream install --sanitize address``) prints a report instead. This module turns those reports into data:

1. It reads lines as the server writes them (:meth:`SanitizerLog.feed`), with no other input: it knows nothing of
   the protocol, the check or the example that caused the report.
2. A report is its sanitizer, its kind (``heap-buffer-overflow``, ``SEGV``, ``stack-overflow``, UBSan's check
   name…), the access (READ/WRITE and size) when the sanitizer names one, and the stack; its *top upstream frame*
   is the first frame in upstream's code, past the sanitizer's interceptors and libc (a memcpy overflow belongs to
   the function that called memcpy).
3. Memory is bounded: a report keeps at most :data:`MAX_REPORT_LINES` lines, the log the last :data:`MAX_REPORTS`
   reports (the count goes on, and a report keeps its number), whatever the server prints and however often it is
   restarted: a campaign reads the reports after a mark, and the newest are the ones it asks for.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: Lines kept per report (an ASan report with its shadow map is about 50).
MAX_REPORT_LINES = 80
#: Reports kept per log (the newest); older ones are counted, not kept.
MAX_REPORTS = 256

_ASAN_ERROR = re.compile(r"==\d+==ERROR: (AddressSanitizer|LeakSanitizer): ([\w-]+)")
#: ASan errors whose first word is not their kind: the names ASan's own documentation gives them.
_PHRASED = (("allocator is out of memory", "out-of-memory"), ("requested allocation size", "allocation-size-too-big"),
            ("attempting double-free", "double-free"), ("attempting free on address", "bad-free"))
#: "SEGV on unknown address 0x10 (pc 0x10 …": the program jumped to the address it faulted on.
_JUMPED = re.compile(r"on unknown address (0x[0-9a-fA-F]+) \(pc (0x[0-9a-fA-F]+)")
_ASAN_ACCESS = re.compile(r"^(READ|WRITE) of size (\d+)")
_ASAN_SIGNAL_ACCESS = re.compile(r"The signal is caused by a (READ|WRITE) memory access")
_UBSAN_ERROR = re.compile(r"^(\S+?:\d+(?::\d+)?): runtime error: (.*)$")
_UBSAN_SUMMARY = re.compile(r"SUMMARY: UndefinedBehaviorSanitizer: ([\w-]+)")
_FRAME = re.compile(r"^\s*#(\d+) 0x[0-9a-fA-F]+ in (.+)$")
_FRAME_NO_SYMBOL = re.compile(r"^\s*#(\d+) 0x[0-9a-fA-F]+ \((.+)\)$")

#: Frames that are not upstream's: the sanitizer runtimes, their interceptors, libc and the C++ runtime.
_RUNTIME_FUNCTION = re.compile(r"^(__asan|__interceptor|___interceptor|__sanitizer|__ubsan|__lsan|__libc|"
                               r"__GI_|_start|abort|raise|__pthread|start_thread|clone|operator new|"
                               r"operator delete|std::)")
_RUNTIME_MODULE = re.compile(r"lib(asan|ubsan|lsan|c|stdc\+\+|gcc_s|m|pthread)[.-]")
#: Source locations of the runtimes (an interceptor symbolised to its own source, glibc's sysdeps).
_RUNTIME_LOCATION = re.compile(r"libsanitizer|sanitizer_common|/asan/|/ubsan/|sysdeps/|libc_start|/libio/")


@dataclass(frozen=True, slots=True)
class Frame:
    """One stack frame: the function (without its parameter list) and where (``file:line`` or ``module+0x…``)."""

    function: str
    location: str

    @property
    def upstream(self) -> bool:
        """A frame of the program or its libraries rather than of a runtime the sanitizer or libc provides."""
        if _RUNTIME_FUNCTION.match(self.function) or _RUNTIME_LOCATION.search(self.location):
            return False
        return not _RUNTIME_MODULE.search(self.location.rsplit("/", 1)[-1])

    @property
    def short(self) -> str:
        """``function (file.cpp:123)``: the location's last path component only."""
        where = self.location.rsplit("/", 1)[-1]
        return f"{self.function} ({where})" if where else self.function


def _frame(text: str) -> Frame:
    """``ggml_foo(ggml_tensor*, int) /path/ggml.c:12:3`` -> Frame("ggml_foo", "/path/ggml.c:12")."""
    function, location = text, ""
    if text.endswith(")") and " (" in text and "+0x" in text.rsplit(" (", 1)[1]:
        function, location = text.rsplit(" (", 1)
        location = location[:-1]
    elif " " in text:
        head, tail = text.rsplit(" ", 1)
        if "/" in tail or re.search(r"\.\w+:\d+", tail):
            function, location = head, tail
    location = re.sub(r"(:\d+):\d+$", r"\1", location)  # the column changes with the compiler, not the bug
    return Frame(_bare_function(function), location)


def _bare_function(name: str) -> str:
    """The function's name without its parameter list (C++ demangled names carry one)."""
    depth = 0
    for i, ch in enumerate(name):
        if ch == "(" and name.startswith("(anonymous namespace)", i):
            continue
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0:
            return name[:i].strip()
    return name.strip()


@dataclass
class SanitizerReport:
    """One report, as the sanitizer printed it."""

    sanitizer: str
    kind: str
    access: str = ""
    size: int | None = None
    #: UBSan: where the undefined behaviour is (``file.cpp:123``) and what it is, as printed.
    where: str = ""
    detail: str = ""
    #: The stack of the faulting access (later stacks, "allocated by" / "freed by", are in ``lines`` only).
    frames: list[Frame] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    _stack_done: bool = field(default=False, repr=False)

    @property
    def short_sanitizer(self) -> str:
        return {"AddressSanitizer": "ASan", "UndefinedBehaviorSanitizer": "UBSan",
                "LeakSanitizer": "LSan"}.get(self.sanitizer, self.sanitizer)

    @property
    def top_frame(self) -> Frame | None:
        """The first frame in upstream's code (None when the stack was not printed or not symbolised)."""
        return next((f for f in self.frames if f.upstream), None)

    @property
    def fatal(self) -> bool:
        """ASan reports end the process; UBSan's (built to recover) let it go on."""
        return self.sanitizer != "UndefinedBehaviorSanitizer"

    @property
    def symptom(self) -> str:
        """The report's class: sanitizer, kind, access and the top upstream frame's function
        (``ASan heap-buffer-overflow READ in ggml_compute_forward_get_rows_f32``). Sizes and addresses are left
        out: the same bug reads a different number of bytes with other inputs."""
        top = self.top_frame
        where = f" in {top.function}" if top else f" at {self.where}" if self.where else ""
        access = f" {self.access}" if self.access else ""
        return f"{self.short_sanitizer} {self.kind}{access}{where}"

    def headline(self) -> str:
        """One line of evidence: the class, the size, the frame's file and line."""
        top = self.top_frame
        size = f" of {self.size} bytes" if self.size is not None else ""
        access = f" {self.access}{size}" if self.access else ""
        place = f" in {top.short}" if top else f" at {self.where}" if self.where else ""
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.sanitizer}: {self.kind}{access}{place}{detail}"

    def to_dict(self) -> dict[str, Any]:
        top = self.top_frame
        return {"sanitizer": self.sanitizer, "kind": self.kind, "access": self.access, "size": self.size,
                "where": self.where, "detail": self.detail, "symptom": self.symptom, "headline": self.headline(),
                "top_frame": top.short if top else None,
                "frames": [f.short for f in self.frames[:12]], "report": list(self.lines)}


class SanitizerLog:
    """Reports parsed from a stream of output lines (thread-safe: a reader thread feeds, others read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (number, report) of the newest reports; a report's number is :attr:`count` before it was seen.
        self._kept: deque[tuple[int, SanitizerReport]] = deque(maxlen=MAX_REPORTS)
        #: Every report seen, kept or not.
        self.count = 0
        self._open: SanitizerReport | None = None

    def feed(self, line: str) -> None:
        """One line of the server's output (without its newline)."""
        with self._lock:
            self._feed(line)

    def _feed(self, line: str) -> None:
        m = _ASAN_ERROR.search(line)
        if m:
            kind = next((k for phrase, k in _PHRASED if phrase in line), m.group(2))
            report = SanitizerReport(m.group(1), kind)
            jumped = _JUMPED.search(line)
            if jumped and int(jumped.group(1), 16) == int(jumped.group(2), 16):
                # No stack to walk: the faulting instruction is the bad address itself, i.e. a call or jump through
                # a pointer that held it (a client-chosen function pointer, #25289).
                report.where = "pc = the faulting address"  # the class; the address itself is the input's
                report.detail = f"a call through a bad pointer (pc {jumped.group(2)} is the faulting address)"
            self._start(report, line)
            return
        m = _UBSAN_ERROR.match(line.strip())
        if m:
            what = m.group(2)
            self._start(SanitizerReport("UndefinedBehaviorSanitizer", _ubsan_kind(what), where=m.group(1),
                                        detail=what[:160]), line)
            return
        report = self._open
        if report is None:
            return
        if len(report.lines) < MAX_REPORT_LINES:
            report.lines.append(line)
        access = _ASAN_ACCESS.match(line.strip()) or _ASAN_SIGNAL_ACCESS.search(line)
        if access and not report.access:
            report.access = access.group(1)
            if access.re is _ASAN_ACCESS:
                report.size = int(access.group(2))
        frame = _FRAME.match(line)
        bare = None if frame else _FRAME_NO_SYMBOL.match(line)
        if report._stack_done or len(report.frames) >= MAX_REPORT_LINES:
            pass
        elif frame:
            report.frames.append(_frame(frame.group(2)))
        elif bare:
            report.frames.append(Frame(f"?{bare.group(2).rsplit('+', 1)[-1]}", bare.group(2)))
        elif report.frames:
            report._stack_done = True  # the first stack is the access's; the next ones are the allocation's
        summary = _UBSAN_SUMMARY.search(line)
        if summary and report.sanitizer == "UndefinedBehaviorSanitizer" and summary.group(1) != "undefined-behavior":
            report.kind = summary.group(1)  # report_error_type=1 names the check: the stabler class
        # UBSan's report ends with its SUMMARY; ASan's goes on with the shadow map until ABORTING.
        if line.startswith("SUMMARY: ") if report.sanitizer == "UndefinedBehaviorSanitizer" else "ABORTING" in line:
            self._open = None

    def _start(self, report: SanitizerReport, line: str) -> None:
        report.lines.append(line)
        self._kept.append((self.count, report))
        self.count += 1
        self._open = report

    @property
    def reports(self) -> list[SanitizerReport]:
        """The kept reports, oldest first."""
        with self._lock:
            return [r for _, r in self._kept]

    def since(self, mark: int) -> list[SanitizerReport]:
        """The kept reports seen after the first ``mark`` ones (``mark``: a previous :attr:`count`)."""
        with self._lock:
            return [r for n, r in self._kept if n >= mark]

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self.count = 0
            self._open = None


def _ubsan_kind(text: str) -> str:
    """A class for a UBSan message when its SUMMARY (which names the check) has not been read yet."""
    for needle, kind in (("signed integer overflow", "signed-integer-overflow"),
                         ("misaligned address", "misaligned-pointer-use"), ("null pointer", "null-pointer-use"),
                         ("out of bounds for type", "bounds"), ("shift exponent", "shift-exponent"),
                         ("is outside the range of representable values", "float-cast-overflow"),
                         ("division by zero", "integer-divide-by-zero"), ("load of value", "invalid-value"),
                         ("pointer index expression", "pointer-overflow"),
                         ("applying non-zero offset", "pointer-overflow")):
        if needle in text:
            return kind
    return "undefined-behavior"


def parse(text: str) -> list[SanitizerReport]:
    """Every report in ``text`` (a whole log)."""
    log = SanitizerLog()
    for line in text.splitlines():
        log.feed(line)
    return log.reports


__all__ = ["MAX_REPORTS", "MAX_REPORT_LINES", "Frame", "SanitizerLog", "SanitizerReport", "parse"]
