// ChatTemplate on an embedded CPython: the interpreter's start, the jinja2 environment (written in
// Python, below, so that it reads like transformers' own), and the calls into it under the GIL.
#include <Python.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "moe/core/status.h"
#include "moe/text/chat_template.h"
#include "python_runtime.h"

namespace moe::text {
namespace {

// The environment of transformers' apply_chat_template (utils/chat_template_utils.py,
// _compile_jinja_template), without the AssistantTracker extension, which only records where
// {% generation %} blocks fall for training masks and leaves the rendered text as it is.
constexpr const char kJinjaEnvironment[] = R"PY(
import datetime
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

def _version(text):
    try:
        return tuple(int(part) for part in text.split(".")[:2])
    except ValueError:
        return (0, 0)

# transformers refuses older versions too: templates use features of 3.1 (e.g. `items` on dicts
# under the sandbox, loop controls).
if _version(jinja2.__version__) < (3, 1):
    raise ImportError(f"jinja2 {jinja2.__version__} is older than 3.1, which chat templates need")

# A naive local datetime that strftime_now reports instead of the clock's, or None.
now_for_testing = None

def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

# Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain json.dumps.
def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

def strftime_now(format):
    now = datetime.datetime.now() if now_for_testing is None else now_for_testing
    return now.strftime(format)

def set_now(seconds, microseconds):
    global now_for_testing
    if seconds is None:
        now_for_testing = None
    else:
        now_for_testing = datetime.datetime.fromtimestamp(seconds).replace(microsecond=microseconds)

# What a template may build: a prompt of 8 Mi characters is far beyond any context, and a string,
# list or output past it is refused before it is made (a template like {{ 'x' * 2000000000 }}
# would otherwise take gigabytes).
MAX_CHARS = 8 * 1024 * 1024

def _too_large(what, size):
    raise jinja2.exceptions.SecurityError(
        f"the template would build {what} of {size} characters or items, more than the {MAX_CHARS} a chat "
        "template may")

def _size(value):
    return len(value) if isinstance(value, (str, list, tuple)) else 0

class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "+", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(count, int) and _size(seq) * max(count, 0) > MAX_CHARS:
                    _too_large("a value", _size(seq) * count)
        elif operator == "+" and _size(left) + _size(right) > MAX_CHARS:
            _too_large("a value", _size(left) + _size(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
            _too_large("a number", right)
        return super().call_binop(context, operator, left, right)

def _bounded_filter(name, filter):
    # A filter that takes the context (or environment) gets it first: the value comes after it.
    first = 1 if hasattr(filter, "jinja_pass_arg") else 0
    def checked(*args, **kwargs):
        for value in list(args[first + 1:]) + list(kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_CHARS:
                _too_large(f"'{name}' output", value)
        if name == "replace" and len(args) >= first + 3 and isinstance(args[first], str):
            s, old, new = str(args[first]), str(args[first + 1]), str(args[first + 2])
            grown = len(s) + (s.count(old) if old else len(s) + 1) * max(len(new) - len(old), 0)
            if grown > MAX_CHARS:
                _too_large("'replace' output", grown)
        result = filter(*args, **kwargs)
        if _size(result) > MAX_CHARS:
            _too_large(f"'{name}' output", _size(result))
        return result
    for attribute in ("jinja_pass_arg", "environmentfilter", "contextfilter", "evalcontextfilter"):
        if hasattr(filter, attribute):
            setattr(checked, attribute, getattr(filter, attribute))
    return checked

def compile(source):
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    for name in ("center", "indent", "format", "replace", "join", "wordwrap", "truncate", "list", "string"):
        if name in env.filters:
            env.filters[name] = _bounded_filter(name, env.filters[name])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)

def render(template, variables_json):
    variables = json.loads(variables_json)
    if not isinstance(variables, dict):
        raise TypeError(f"the template variables must be a JSON object, not {type(variables).__name__}")
    # As one mapping rather than **kwargs, so that a key named like render()'s own parameter
    # ("self") cannot make the call itself fail. Piece by piece, so that an output past the limit
    # stops where it passes it.
    pieces, size = [], 0
    for piece in template.generate(variables):
        size += len(piece)
        if size > MAX_CHARS:
            _too_large("a prompt", size)
        pieces.append(piece)
    return "".join(pieces)

# "Type: message (chat template line N)": Jinja's message, and the template line it came from
# (Jinja rewrites tracebacks so that template frames carry the template's own line numbers).
def describe(error):
    if isinstance(error, jinja2.exceptions.TemplateSyntaxError):
        return f"{type(error).__name__}: {error.message} (chat template line {error.lineno})"
    text = f"{type(error).__name__}: {error}"
    line = None
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == "<template>":
            line = frame.tb_lineno
        frame = frame.tb_next
    return text if line is None else f"{text} (chat template line {line})"
)PY";

constexpr const char kInstallHint[] = "chat templates need jinja2 3.1 or later: install python3-jinja2";

// Holds the GIL for its scope, on any thread (PyGILState creates a thread state when the thread
// has none).
class GilHold {
 public:
  GilHold() : state_(PyGILState_Ensure()) {}
  ~GilHold() { PyGILState_Release(state_); }
  GilHold(const GilHold&) = delete;
  GilHold& operator=(const GilHold&) = delete;

 private:
  PyGILState_STATE state_;
};

// A strong reference, released on scope exit; only ever declared inside a GilHold's scope.
class PyRef {
 public:
  explicit PyRef(PyObject* object = nullptr) : object_(object) {}
  ~PyRef() { Py_XDECREF(object_); }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  PyObject* get() const { return object_; }
  PyObject* release() {
    PyObject* object = object_;
    object_ = nullptr;
    return object;
  }
  explicit operator bool() const { return object_ != nullptr; }

 private:
  PyObject* object_;
};

// str(object) as UTF-8, or `fallback` (with the Python error cleared) when that fails.
std::string ToUtf8(PyObject* object, const char* fallback) {
  PyRef text(PyObject_Str(object));
  Py_ssize_t size = 0;
  const char* data = text ? PyUnicode_AsUTF8AndSize(text.get(), &size) : nullptr;
  if (data == nullptr) {
    PyErr_Clear();
    return fallback;
  }
  return std::string(data, static_cast<size_t>(size));
}

// Takes the pending Python exception and returns it as a message, via `describe` when given.
std::string TakeError(PyObject* describe) {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  PyRef type_ref(type), value_ref(value), traceback_ref(traceback);
  if (value == nullptr) return "unknown Python error";
  if (traceback != nullptr) PyException_SetTraceback(value, traceback);
  if (describe != nullptr) {
    PyRef described(PyObject_CallOneArg(describe, value));
    if (described) return ToUtf8(described.get(), "unknown Python error");
    PyErr_Clear();
  }
  PyRef name(type != nullptr ? PyObject_GetAttrString(type, "__name__") : nullptr);
  PyErr_Clear();
  const std::string prefix = name ? ToUtf8(name.get(), "") + ": " : "";
  return prefix + ToUtf8(value, "unknown Python error");
}

// Python's version and its standard library's folder, for messages about what it could not import.
std::string DescribeInterpreter() {
  PyRef sys(PyImport_ImportModule("sys"));
  PyRef version(sys ? PyObject_GetAttrString(sys.get(), "version") : nullptr);
  PyRef prefix(sys ? PyObject_GetAttrString(sys.get(), "prefix") : nullptr);
  PyErr_Clear();
  std::string version_text = version ? ToUtf8(version.get(), "?") : "?";
  version_text = version_text.substr(0, version_text.find(' '));
  return absl::StrCat("Python ", version_text, " at ", prefix ? ToUtf8(prefix.get(), "?") : "?");
}

// Starts the interpreter: isolated (no PYTHONPATH or PYTHONHOME from the environment, which may
// describe another Python; no user site-packages; no setlocale on this process), UTF-8 mode, no
// signal handlers (SIGINT stays the server's), no .pyc written into system folders. Then releases
// the GIL, which any thread takes back with PyGILState_Ensure. Fails with kUnavailable rather than
// Python's fatal error when the standard library is missing.
absl::Status StartInterpreter() {
  // A host that embeds Python itself (a Python extension) has started it and owns the GIL rules.
  if (Py_IsInitialized()) return absl::OkStatus();
  PyPreConfig preconfig;
  PyPreConfig_InitIsolatedConfig(&preconfig);
  preconfig.utf8_mode = 1;
  PyStatus status = Py_PreInitialize(&preconfig);
  if (PyStatus_Exception(status)) {
    return absl::UnavailableError(absl::StrCat(
        "the embedded Python cannot start: ", status.err_msg != nullptr ? status.err_msg : "?", "; ", kInstallHint));
  }
  PyConfig config;
  PyConfig_InitIsolatedConfig(&config);
  config.install_signal_handlers = 0;
  config.write_bytecode = 0;
  // sys.prefix is found from the interpreter's path, as /usr/bin/python3 finds its own, rather than
  // from the first python3 on PATH.
  status = PyConfig_SetBytesString(&config, &config.program_name, MOE_PYTHON_EXECUTABLE);
  if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
  PyConfig_Clear(&config);
  if (PyStatus_Exception(status)) {
    return absl::UnavailableError(absl::StrCat("the embedded Python (", MOE_PYTHON_EXECUTABLE, ") cannot start: ",
                                               status.err_msg != nullptr ? status.err_msg : "?", "; ", kInstallHint));
  }
  PyEval_SaveThread();
  return absl::OkStatus();
}

const absl::Status& Interpreter() {
  static const absl::Status* const status = new absl::Status(StartInterpreter());
  return *status;
}

// The functions of kJinjaEnvironment, alive for the process (borrowed from its module's dict,
// which is never freed).
struct JinjaFunctions {
  PyObject* compile = nullptr;
  PyObject* render = nullptr;
  PyObject* describe = nullptr;
  PyObject* set_now = nullptr;
};

absl::StatusOr<JinjaFunctions> LoadJinjaEnvironment() {
  MOE_RETURN_IF_ERROR(internal::ImportPythonModule("jinja2"));
  GilHold gil;
  PyRef module(PyModule_New("moe_chat_template"));
  if (!module) return absl::UnavailableError("the embedded Python cannot create a module: " + TakeError(nullptr));
  PyObject* globals = PyModule_GetDict(module.get());  // borrowed
  PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins());
  PyRef ran(PyRun_String(kJinjaEnvironment, Py_file_input, globals, globals));
  if (!ran) {
    return absl::UnavailableError(absl::StrCat("the embedded ", DescribeInterpreter(),
                                               " cannot set up jinja2: ", TakeError(nullptr), "; ", kInstallHint));
  }
  JinjaFunctions functions;
  functions.compile = PyDict_GetItemString(globals, "compile");
  functions.render = PyDict_GetItemString(globals, "render");
  functions.describe = PyDict_GetItemString(globals, "describe");
  functions.set_now = PyDict_GetItemString(globals, "set_now");
  module.release();  // kept for the process: the functions above are borrowed from it
  return functions;
}

const absl::StatusOr<JinjaFunctions>& Jinja() {
  static const absl::StatusOr<JinjaFunctions>* const jinja = new absl::StatusOr<JinjaFunctions>(LoadJinjaEnvironment());
  return *jinja;
}

// A new str from UTF-8 bytes, or kInvalidArgument naming `what` (the GIL is held).
absl::StatusOr<PyObject*> Utf8ToPython(std::string_view text, const char* what) {
  PyObject* object = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "strict");
  if (object == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid UTF-8: ", TakeError(nullptr)));
  }
  return object;
}

}  // namespace

namespace internal {

absl::Status ImportPythonModule(const std::string& module) {
  MOE_RETURN_IF_ERROR(Interpreter());
  GilHold gil;
  PyRef imported(PyImport_ImportModule(module.c_str()));
  if (imported) return absl::OkStatus();
  const std::string error = TakeError(nullptr);
  return absl::UnavailableError(absl::StrCat("the embedded ", DescribeInterpreter(), " cannot import ", module, " (",
                                             error, "); ", kInstallHint));
}

}  // namespace internal

struct ChatTemplate::PythonTemplate {
  PyObject* template_ = nullptr;  // a strong reference to the jinja2.Template
};

ChatTemplate::ChatTemplate(std::unique_ptr<PythonTemplate> compiled) : compiled_(std::move(compiled)) {}

ChatTemplate::~ChatTemplate() {
  if (compiled_ == nullptr || compiled_->template_ == nullptr) return;
  GilHold gil;
  Py_DECREF(compiled_->template_);
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::Compile(const std::string& source) {
  const absl::StatusOr<JinjaFunctions>& jinja = Jinja();
  if (!jinja.ok()) return jinja.status();
  GilHold gil;
  MOE_ASSIGN_OR_RETURN(PyObject * text, Utf8ToPython(source, "the chat template"));
  PyRef source_ref(text);
  PyRef compiled(PyObject_CallOneArg(jinja->compile, text));
  if (!compiled) return absl::InvalidArgumentError(TakeError(jinja->describe));
  auto python = std::make_unique<PythonTemplate>();
  python->template_ = compiled.release();
  return std::unique_ptr<ChatTemplate>(new ChatTemplate(std::move(python)));
}

absl::StatusOr<std::string> ChatTemplate::RenderJsonText(std::string_view variables_json) const {
  const JinjaFunctions& jinja = *Jinja();  // ok: this template was compiled
  GilHold gil;
  MOE_ASSIGN_OR_RETURN(PyObject * text, Utf8ToPython(variables_json, "the template variables"));
  PyRef text_ref(text);
  PyRef rendered(PyObject_CallFunctionObjArgs(jinja.render, compiled_->template_, text, nullptr));
  if (!rendered) return absl::InvalidArgumentError(TakeError(jinja.describe));
  Py_ssize_t size = 0;
  // Fails for a lone surrogate ("\ud800" in the JSON), which has no UTF-8 form.
  const char* data = PyUnicode_AsUTF8AndSize(rendered.get(), &size);
  if (data == nullptr) {
    return absl::InvalidArgumentError("the rendered prompt has no UTF-8 form: " + TakeError(jinja.describe));
  }
  return std::string(data, static_cast<size_t>(size));
}

void ChatTemplate::SetNowForTesting(std::optional<std::chrono::system_clock::time_point> now) {
  const absl::StatusOr<JinjaFunctions>& jinja = Jinja();
  if (!jinja.ok()) return;  // nothing can render, so there is no time to set
  GilHold gil;
  PyObject* result = nullptr;
  if (now.has_value()) {
    const int64_t micros = std::chrono::duration_cast<std::chrono::microseconds>(now->time_since_epoch()).count();
    // Floor division, so that a time before 1970 keeps microseconds in [0, 1e6).
    int64_t seconds = micros / 1'000'000, rest = micros % 1'000'000;
    if (rest < 0) {
      rest += 1'000'000;
      seconds -= 1;
    }
    result = PyObject_CallFunction(jinja->set_now, "LL", static_cast<long long>(seconds), static_cast<long long>(rest));
  } else {
    result = PyObject_CallFunction(jinja->set_now, "OO", Py_None, Py_None);
  }
  PyRef done(result);
  if (!done) PyErr_Clear();  // only a time out of datetime's range; the clock stays in use
}

}  // namespace moe::text
