"""A Responses body's tools as a chat runtime takes them. Function tools map one to one.
A `namespace` tool (a group of function tools that calls name with a `namespace`, as
Codex sends its sub-agent tools) is flattened into its function tools, and their calls
come back naming their namespace again. Every other tool type (web_search, file_search,
computer_use, code_interpreter, image_generation, mcp, local_shell, custom, ...) has no
Chat Completions equivalent: it is skipped, as llama-server's own Responses route skips
it, and the answer says which (the `x-llm-pool-skipped-tools` header, the request log).
No I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ErrorCode, PoolError
from supervisor.request_bounds import echo

MAX_SKIPPED_SHOWN = 400  # characters of the skipped tools' list a header or a row carries


@dataclass
class ChatTools:
    """What `chat_tools` made of a body's tools."""
    tools: list[dict] = field(default_factory=list)  # the chat runtime's function tools
    skipped: list[str] = field(default_factory=list)  # each left out: its type, and its name where it has one
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # chat name -> (namespace, name)
    chat_names: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, name) -> chat name

    def chat_name(self, name: str, namespace: str | None) -> str:
        """The name the runtime knows a (namespaced) function by."""
        return self.chat_names.get((namespace, name), name) if namespace else name

    def call_names(self, chat_name: str) -> dict:
        """A function_call item's name (and namespace) for a call the runtime made by `chat_name`."""
        if chat_name in self.namespaced:
            namespace, name = self.namespaced[chat_name]
            return {"name": name, "namespace": namespace}
        return {"name": chat_name}

    def skipped_text(self) -> str | None:
        """The skipped tools, comma-separated (printable ASCII, as a header must be); None: none."""
        if not self.skipped:
            return None
        text = ", ".join(self.skipped).encode("ascii", "backslashreplace").decode()
        text = "".join(c if " " <= c <= "~" else "?" for c in text)
        return text if len(text) <= MAX_SKIPPED_SHOWN else text[:MAX_SKIPPED_SHOWN - 3] + "..."


def _bad(message: str, param: str) -> PoolError:
    return PoolError(ErrorCode.INVALID_REQUEST, message, param=param)


def _function(tool: dict, param: str) -> dict:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise _bad("a function tool needs a name", f"{param}.name")
    return {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}


def _label(tool: dict, namespace: str | None = None) -> str:
    kind = tool.get("type")
    label = kind if isinstance(kind, str) and kind else "untyped"
    name = tool.get("name")
    if isinstance(name, str) and name:
        label += f" {namespace + '.' if namespace else ''}{name}"
    return label


def chat_tools(tools: list) -> ChatTools:
    """The chat runtime's tools for a Responses body's `tools`. A namespaced function keeps
    its own name unless another tool holds it; then it is `namespace__name`."""
    out = ChatTools()
    taken = {t.get("name") for t in tools if isinstance(t, dict) and t.get("type") == "function"}
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad("a tool must be an object", f"tools.{n}")
        if tool.get("type") == "function":
            out.tools.append({"type": "function", "function": _function(tool, f"tools.{n}")})
        elif tool.get("type") == "namespace":
            _flatten(tool, n, out, taken)
        else:
            out.skipped.append(_label(tool))
    return out


def _flatten(tool: dict, n: int, out: ChatTools, taken: set) -> None:
    namespace, inner = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace:
        raise _bad("a namespace tool needs a name", f"tools.{n}.name")
    if not isinstance(inner, list):
        raise _bad("a namespace tool needs its tools (a list)", f"tools.{n}.tools")
    for m, member in enumerate(inner):
        param = f"tools.{n}.tools.{m}"
        if not isinstance(member, dict):
            raise _bad("a tool must be an object", param)
        if member.get("type") != "function":
            out.skipped.append(_label(member, namespace))
            continue
        function = _function(member, param)
        name = function["name"]
        chat_name = name if name not in taken else f"{namespace}__{name}"
        if chat_name in taken:
            raise _bad(f"tool {echo(name)} of namespace {echo(namespace)} is listed twice", f"{param}.name")
        taken.add(chat_name)
        out.namespaced[chat_name] = (namespace, name)
        out.chat_names[(namespace, name)] = chat_name
        out.tools.append({"type": "function", "function": {**function, "name": chat_name}})


def chat_tool_choice(choice, tools: ChatTools) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad(f"tool_choice {echo(choice)} is not auto, none or required", "tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        namespace = choice.get("namespace") if isinstance(choice.get("namespace"), str) else None
        return {"type": "function", "function": {"name": tools.chat_name(choice["name"], namespace)}}
    raise PoolError(ErrorCode.UNSUPPORTED_PARAMETER, f"tool_choice of type {echo(choice.get('type'))} is not "
                    "supported", param="tool_choice")
