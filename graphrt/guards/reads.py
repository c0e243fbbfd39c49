"""What a step's code reads by attribute, from its bytecode: the names it loads through ``self`` and
through the globals it loads.

A replay runs none of the step's Python, so what a lookup found at capture is frozen: ``self.scale``
found on the class (``MyAttention.softmax_scale``), ``self.forward`` patched on the class, ``self.config``
(an object changed in place), ``Settings.temperature`` (a class read as a global). The guards read the
names from the code objects that ran (graphrt.guards.observe): ``self.name``, ``self.__class__.name`` and
``type(self).name`` per method, with the code nested in it that closes over ``self`` (a comprehension, a
lambda: code objects of their own), ``self.name.attribute``, ``GLOBAL.name`` per function, as torch.compile
builds a guard per attribute source it traced. A read the bytecode cannot name (``getattr(self, name)``
with a computed name) is told apart (``computed_names``): every attribute of what such code reads counts.
"""

from __future__ import annotations

import dis
import types
from typing import AbstractSet, Dict, List, Optional, Set, Tuple

# Instructions that do not change what the next attribute load is applied to.
_TRANSPARENT = frozenset({"CACHE", "PRECALL", "NOP", "EXTENDED_ARG", "PUSH_NULL", "KW_NAMES", "COPY_FREE_VARS",
                          "RESUME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_LOCAL_LOADS = ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")
Pair = Tuple[Optional[int], str, str]  # (line, owner, name): GLOBAL.name, self.owner.name
Scan = Tuple[List[Tuple[Optional[int], str]], List[Pair], List[Pair]]  # through self, through globals, chains
_scans: Dict[Tuple[types.CodeType, Optional[str]], Scan] = {}


def self_attributes(code: types.CodeType, lines: Optional[AbstractSet[int]] = None) -> Set[str]:
    """The attribute names ``code`` (a method: its first argument is the object) loads from its first
    argument, from ``self.__class__`` and from ``type(self)``, and so does the code nested in it that closes
    over that argument (a comprehension, a lambda: every line); ``lines``: only on those (the lines that ran)."""
    return {name for line, name in _scan(code)[0] if lines is None or line is None or line in lines}


def self_chains(code: types.CodeType, lines: Optional[AbstractSet[int]] = None) -> Set[Tuple[str, str]]:
    """``(name, attribute)`` for every ``self.name.attribute`` load in ``code`` (``self.config.softcap``) and in
    the code nested in it that closes over ``self``."""
    return {(owner, name) for line, owner, name in _scan(code)[2] if lines is None or line is None or line in lines}


def global_attributes(code: types.CodeType, lines: Optional[AbstractSet[int]] = None) -> Set[Tuple[str, str]]:
    """``(global, attribute)`` for every ``GLOBAL.attribute`` load in ``code`` (on ``lines`` only, when
    given) and in the code nested in it (comprehensions: every line)."""
    return {(owner, name) for line, owner, name in _scan(code)[1] if lines is None or line is None or line in lines}


def attribute_names(code: types.CodeType, lines: Optional[AbstractSet[int]] = None) -> Set[str]:
    """Every attribute name ``code`` loads, whatever from (``x.name``, ``x.name()``), and the constant names it
    passes to ``getattr``/``hasattr`` on a line (``getattr(config, "sliding_window", None)``); ``lines``: only
    on those. A name computed at run time is not seen."""
    return {name for line, name in _named_reads(code) if lines is None or line is None or line in lines}


_named: Dict[types.CodeType, List[Tuple[Optional[int], str]]] = {}


def _named_reads(code: types.CodeType) -> List[Tuple[Optional[int], str]]:
    found = _named.get(code)
    if found is not None:
        return found
    found, constants, getters = [], [], set()
    for instruction in dis.get_instructions(code):
        line = instruction.positions.lineno if instruction.positions else None
        if instruction.opname in _ATTRIBUTE_LOADS and isinstance(instruction.argval, str):
            found.append((line, instruction.argval))
        elif instruction.opname == "LOAD_CONST" and isinstance(instruction.argval, str):
            constants.append((line, instruction.argval))
        elif instruction.opname == "LOAD_GLOBAL" and instruction.argval in ("getattr", "hasattr"):
            getters.add(line)
    found += [(line, name) for line, name in constants if line in getters]
    _named[code] = found
    return found


_GETTERS = ("getattr", "hasattr")
_CALLS = ("PRECALL", "CALL")  # the instruction whose argument count closes a call's arguments (3.11: PRECALL first)
_computed: Dict[types.CodeType, List[Optional[int]]] = {}


def computed_names(code: types.CodeType, lines: Optional[AbstractSet[int]] = None) -> bool:
    """Whether ``code`` passes ``getattr``/``hasattr`` a name that is no constant (``getattr(self.scales,
    "scale_" + kind)``) on ``lines`` (all when None): which attribute it reads, the bytecode cannot tell."""
    found = _computed.get(code)
    if found is None:
        instructions = [instruction for instruction in dis.get_instructions(code)
                        if instruction.opname not in _TRANSPARENT]
        found = _computed[code] = [
            instruction.positions.lineno if instruction.positions else None
            for index, instruction in enumerate(instructions)
            if instruction.opname == "LOAD_GLOBAL" and instruction.argval in _GETTERS
            and not _constant_name(instructions, index)]
    return any(lines is None or line is None or line in lines for line in found)


def _constant_name(instructions: List[dis.Instruction], start: int) -> bool:
    """Whether the call of the getter ``instructions[start]`` loads passes a constant string as its second
    argument; False where the call's shape is not followed (a branch among its arguments)."""
    depth, call = 0, None
    for index in range(start + 1, len(instructions)):
        instruction = instructions[index]
        if instruction.opcode in dis.hasjrel or instruction.opcode in dis.hasjabs:
            return False
        if instruction.opname in _CALLS and depth == instruction.arg:
            call = index
            break
        depth += dis.stack_effect(instruction.opcode, instruction.arg)
    if call is None or instructions[call].arg < 2:
        return False
    index = call - 1
    for argument in range(instructions[call].arg - 1, 0, -1):  # back from the last argument to the second
        pushed, first = 0, index
        while pushed < 1 and index > start:
            pushed += dis.stack_effect(instructions[index].opcode, instructions[index].arg)
            index -= 1
        if argument == 1:
            name = instructions[first]
            return first == index + 1 and name.opname == "LOAD_CONST" and isinstance(name.argval, str)
    return False


APPENDS = frozenset({"append", "appendleft", "extend", "add", "insert"})


def only_appended(code: types.CodeType, name: str) -> bool:
    """Whether every load of the closure cell or global ``name`` in ``code`` is the object of an append
    (``logged.append(value)``): a log the step writes, whose contents it never reads."""
    instructions = [instruction for instruction in dis.get_instructions(code) if instruction.opname not in _TRANSPARENT]
    loads = [index for index, instruction in enumerate(instructions)
             if instruction.opname in ("LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL", "LOAD_NAME")
             and instruction.argval == name]
    return bool(loads) and all(index + 1 < len(instructions) and instructions[index + 1].opname in _ATTRIBUTE_LOADS
                               and instructions[index + 1].argval in APPENDS for index in loads)


def _loads_first_argument(instruction: dis.Instruction, first: Optional[str]) -> bool:
    if first is None or not instruction.opname.startswith(_LOCAL_LOADS):
        return False
    value = instruction.argval
    return value == first or isinstance(value, tuple) and value[-1] == first  # LOAD_FAST_LOAD_FAST (3.13)


def _scan(code: types.CodeType, outer_self: Optional[str] = None) -> Scan:
    """``code``'s loads through its first argument (or, for code nested in a method, through the method's
    first argument it closes over: ``outer_self``), through globals, and ``self.name.attribute`` chains."""
    scanned = _scans.get((code, outer_self))
    if scanned is not None:
        return scanned
    first = outer_self if outer_self is not None else code.co_varnames[0] if code.co_argcount else None
    through_self: List[Tuple[Optional[int], str]] = []
    through_globals: List[Pair] = []
    chains: List[Pair] = []
    state: Optional[str] = None  # what the next attribute load applies to: "self", "class", "type(", "type(self"
    global_name: Optional[str] = None
    owner: Optional[str] = None  # the attribute of self just loaded (self.owner.name)
    for instruction in dis.get_instructions(code):
        opname = instruction.opname
        if opname in _TRANSPARENT:
            continue
        if opname in _ATTRIBUTE_LOADS:
            name, line = instruction.argval, instruction.positions.lineno if instruction.positions else None
            if state == "self" and name == "__class__":
                state = "class"
                continue
            loaded_owner, owner = owner, None
            if state in ("self", "class"):
                through_self.append((line, name))
                owner = name if state == "self" else None
            elif global_name is not None:
                through_globals.append((line, global_name, name))
            elif loaded_owner is not None:
                chains.append((line, loaded_owner, name))
            state, global_name = None, None
            continue
        next_state: Optional[str] = None
        global_name, owner = None, None
        if _loads_first_argument(instruction, first):
            next_state = "type(self" if state == "type(" else "self"
        elif opname == "LOAD_GLOBAL":
            next_state = "type(" if instruction.argval == "type" else None
            global_name = instruction.argval if isinstance(instruction.argval, str) else None
        elif opname == "CALL" and state == "type(self":
            next_state = "class"
        state = next_state
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # comprehensions and nested functions: their global loads, and
            # their loads through the method's first argument when they close over it ([self.scale * h for h in hs])
            closes = first if first is not None and first in constant.co_freevars else None
            nested_self, nested_globals, nested_chains = _scan(constant, closes)
            through_globals += [(None, outer, name) for _, outer, name in nested_globals]
            if closes is not None:
                through_self += [(None, name) for _, name in nested_self]
                chains += [(None, owner, name) for _, owner, name in nested_chains]
    scanned = _scans[(code, outer_self)] = (through_self, through_globals, chains)
    return scanned
