//! A pickle read as data, never run. `torch.save` writes a state dict as a pickle whose objects
//! are rebuilt by calling globals (`torch._utils._rebuild_tensor_v2`, `collections.OrderedDict`);
//! Python's unpickler would call them — and any other a file names, `os.system` included. This
//! one calls nothing: it runs the opcodes that build data (protocols 2–5: numbers, strings,
//! tuples, lists, dicts, the memo), and turns each call into a [`Value::Object`] recording what
//! would have been called with what, for the caller to interpret. A global is accepted only if
//! [`allowed`] names it — the handful torch writes for tensors, storages, dtypes and DTensors —
//! and any other is refused by name before anything is built from it. Bounded: at most
//! [`MAX_DEPTH`] nested containers when interpreted, [`MAX_MEMO`] memo entries, the input's own
//! length for every string.

use super::cursor::Cursor;
use anyhow::{bail, ensure, Context, Result};
use std::cell::RefCell;
use std::rc::Rc;

/// The deepest nesting a caller walks (a state dict is a few levels deep; a DTensor's a dozen).
pub const MAX_DEPTH: usize = 64;
/// The most memo entries.
const MAX_MEMO: usize = 1 << 24;

/// A value a pickle builds.
#[derive(Clone, Debug)]
pub enum Value {
    /// `None`.
    None,
    /// `True`, `False`.
    Bool(bool),
    /// An integer that fits 64 bits.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(Rc<str>),
    /// Bytes.
    Bytes(Rc<[u8]>),
    /// A tuple.
    Tuple(Rc<[Value]>),
    /// A list.
    List(Rc<RefCell<Vec<Value>>>),
    /// A dict, its items in order.
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
    /// A global the pickle names: `module.name`, one [`allowed`] accepts.
    Global(Rc<str>),
    /// What a call would have built: `callable(*args)` (REDUCE) or `cls.__new__(cls, *args)`
    /// (NEWOBJ), then its `state` (BUILD) and items (an `OrderedDict()`'s SETITEMs).
    Object(Rc<RefCell<Object>>),
    /// A persistent id (`BINPERSID`): torch's reference to a storage outside the pickle.
    Persistent(Rc<Value>),
}

/// A call the pickle asked for, not made.
#[derive(Debug)]
pub struct Object {
    /// The global called (or whose class was instantiated).
    pub callable: Value,
    /// Its arguments (a tuple).
    pub args: Value,
    /// The state BUILD gave it.
    pub state: Option<Value>,
    /// Items set on it (an `OrderedDict` built by a call, then filled).
    pub items: Vec<(Value, Value)>,
}

impl Value {
    /// The global's name, for an object: what it calls.
    pub fn callable_name(&self) -> Option<Rc<str>> {
        match self {
            Value::Object(o) => match &o.borrow().callable {
                Value::Global(name) => Some(name.clone()),
                _ => None,
            },
            _ => None,
        }
    }

    /// A short description of the value's kind, for messages.
    pub fn kind(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(_) => "a bool".into(),
            Value::Int(_) => "an integer".into(),
            Value::Float(_) => "a float".into(),
            Value::Str(_) => "a string".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Tuple(_) => "a tuple".into(),
            Value::List(_) => "a list".into(),
            Value::Dict(_) => "a dict".into(),
            Value::Global(g) => format!("the global {g}"),
            Value::Object(_) => match self.callable_name() {
                Some(name) => format!("a {name} object"),
                None => "an object".into(),
            },
            Value::Persistent(_) => "a persistent id".into(),
        }
    }
}

/// Whether a pickle may name the global `name` (`module.name`): the functions torch rebuilds
/// tensors and parameters with, its storage classes and dtypes, `torch.Size`, `torch.device`,
/// `collections.OrderedDict`, the classes of DTensors, their specs, meshes and placements —
/// what `torch.save` writes for a state dict of tensors or DTensors — and the data classes of a
/// torch DCP checkpoint's metadata. Nothing it names is called.
pub fn allowed(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "collections.OrderedDict",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._utils._rebuild_wrapper_subclass",
        "torch._tensor._rebuild_from_type_v2",
        "torch.Size",
        "torch.device",
        "torch.serialization._get_layout",
        "torch.strided",
        // A torch DCP checkpoint's `.metadata`: where each chunk is, the path it was saved to.
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
    ];
    const STORAGES: &[&str] = &[
        "BFloat16", "Half", "Float", "Double", "Long", "Int", "Short", "Char", "Byte", "Bool",
    ];
    const DTYPES: &[&str] = &[
        "bfloat16",
        "float16",
        "half",
        "float32",
        "float",
        "float64",
        "double",
        "int64",
        "long",
        "int32",
        "int",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    ];
    // The classes of a DTensor's spec, mesh and placements move between torch versions; they are
    // data classes, built and never called.
    const DISTRIBUTED: &[&str] = &[
        "torch.distributed.tensor.",
        "torch.distributed._tensor.",
        "torch.distributed.device_mesh.",
        "torch.distributed._mesh_layout.",
        "torch.distributed.checkpoint.metadata.",
    ];
    if EXACT.contains(&name) || DISTRIBUTED.iter().any(|p| name.starts_with(p)) {
        return true;
    }
    match name.strip_prefix("torch.") {
        Some(rest) => {
            rest.strip_suffix("Storage")
                .is_some_and(|s| STORAGES.contains(&s))
                || DTYPES.contains(&rest)
                || rest == "storage.UntypedStorage"
        }
        None => false,
    }
}

/// Reads `bytes` as a pickle and returns the value it builds. `what` names the pickle in
/// messages (`FILE's data.pkl`). A global [`allowed`] refuses is a usage error naming it.
pub fn read(bytes: &[u8], what: &str) -> Result<Value> {
    Machine::new(bytes)
        .run()
        .with_context(|| format!("{what}: cannot read its pickle"))
}

/// The unpickler's state: the input, its position, the stack with its marks, and the memo.
struct Machine<'a> {
    input: Cursor<'a>,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: std::collections::HashMap<u64, Value>,
}

/// A refusal that names what the pickle asked for; shown as a usage error.
fn refused(name: &str) -> anyhow::Error {
    crate::error::usage(format!(
        "it names the global '{}', which a checkpoint of tensors has no use for: rlmerge reads a \
         pickle as data and accepts only the globals torch writes for tensors, storages and \
         DTensors (it never calls one)",
        crate::escape::terminal(name)
    ))
}

impl<'a> Machine<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Machine {
            input: Cursor::new(bytes, "it ends inside an opcode"),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Default::default(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        self.input.take(n)
    }

    fn u8(&mut self) -> Result<u8> {
        self.input.u8()
    }

    fn u32(&mut self) -> Result<u32> {
        self.input.u32()
    }

    fn u64(&mut self) -> Result<u64> {
        self.input.u64()
    }

    fn line(&mut self) -> Result<&'a str> {
        let rest = self.input.rest();
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .context("a text argument without its newline")?;
        let text = std::str::from_utf8(&rest[..n]).context("a text argument that is not UTF-8")?;
        self.input.take(n + 1)?;
        Ok(text)
    }

    fn pop(&mut self) -> Result<Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        ensure!(self.stack.len() > floor, "it pops an empty stack");
        Ok(self.stack.pop().expect("checked"))
    }

    fn top(&mut self) -> Result<&Value> {
        self.stack
            .last()
            .context("it uses the top of an empty stack")
    }

    /// The values pushed since the last MARK, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let mark = self
            .marks
            .pop()
            .context("it closes a MARK it never opened")?;
        Ok(self.stack.split_off(mark))
    }

    fn push_str(&mut self, n: usize) -> Result<()> {
        let text = std::str::from_utf8(self.take(n)?).context("a string that is not UTF-8")?;
        self.stack.push(Value::Str(text.into()));
        Ok(())
    }

    fn push_bytes(&mut self, n: usize) -> Result<()> {
        let bytes = self.take(n)?;
        self.stack.push(Value::Bytes(bytes.into()));
        Ok(())
    }

    fn memo_put(&mut self, key: u64) -> Result<()> {
        ensure!(
            self.memo.len() < MAX_MEMO,
            "more than {MAX_MEMO} memo entries"
        );
        let v = self.top()?.clone();
        self.memo.insert(key, v);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<()> {
        let v = self
            .memo
            .get(&key)
            .with_context(|| format!("memo entry {key} is read before it is written"))?;
        self.stack.push(v.clone());
        Ok(())
    }

    fn global(&mut self, module: &str, name: &str) -> Result<()> {
        let full = format!("{module}.{name}");
        if !allowed(&full) {
            return Err(refused(&full));
        }
        self.stack.push(Value::Global(full.into()));
        Ok(())
    }

    fn run(mut self) -> Result<Value> {
        loop {
            let at = self.input.at;
            let op = self.u8()?;
            if self
                .step(op)
                .with_context(|| format!("opcode 0x{op:02x} at byte {at}"))?
            {
                ensure!(
                    self.stack.len() == 1,
                    "it stops with {} values on its stack",
                    self.stack.len()
                );
                return Ok(self.stack.pop().expect("one value"));
            }
        }
    }

    /// Runs opcode `op`; whether it was STOP.
    fn step(&mut self, op: u8) -> Result<bool> {
        match op {
            b'.' => return Ok(true),
            0x80 => {
                let protocol = self.u8()?;
                ensure!(
                    (2..=5).contains(&protocol),
                    "pickle protocol {protocol} (2 to 5 are read)"
                );
            }
            0x95 => {
                self.u64()?; // FRAME: its length; the frames' bytes follow in order.
            }
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self.top()?.clone();
                self.stack.push(v);
            }
            b'N' => self.stack.push(Value::None),
            0x88 => self.stack.push(Value::Bool(true)),
            0x89 => self.stack.push(Value::Bool(false)),
            b'J' => {
                let v = i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"));
                self.stack.push(Value::Int(v.into()));
            }
            b'K' => {
                let v = self.u8()?;
                self.stack.push(Value::Int(v.into()));
            }
            b'M' => {
                let v = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
                self.stack.push(Value::Int(v.into()));
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.u8()? as usize
                } else {
                    self.u32()? as usize
                };
                let bytes = self.take(n)?;
                self.stack.push(Value::Int(long(bytes)?));
            }
            b'G' => {
                let v = f64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes"));
                self.stack.push(Value::Float(v));
            }
            b'X' => {
                let n = self.u32()? as usize;
                self.push_str(n)?;
            }
            0x8c => {
                let n = self.u8()? as usize;
                self.push_str(n)?;
            }
            0x8d => {
                let n = usize::try_from(self.u64()?).context("a string longer than memory")?;
                self.push_str(n)?;
            }
            b'T' | b'B' => {
                let n = self.u32()? as usize;
                self.push_bytes(n)?;
            }
            b'U' | b'C' => {
                let n = self.u8()? as usize;
                self.push_bytes(n)?;
            }
            0x8e => {
                let n = usize::try_from(self.u64()?).context("bytes longer than memory")?;
                self.push_bytes(n)?;
            }
            _ => return self.containers(op),
        }
        Ok(false)
    }

    /// The opcodes that build containers.
    fn containers(&mut self, op: u8) -> Result<bool> {
        match op {
            b')' => self.stack.push(Value::Tuple(Rc::from(Vec::new()))),
            b't' => {
                let items = self.pop_mark()?;
                self.stack.push(Value::Tuple(items.into()));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let floor = self.marks.last().copied().unwrap_or(0);
                ensure!(
                    self.stack.len() >= floor + n,
                    "a tuple of {n} from a shorter stack"
                );
                let items = self.stack.split_off(self.stack.len() - n);
                self.stack.push(Value::Tuple(items.into()));
            }
            b']' => self.stack.push(Value::List(Default::default())),
            b'l' => {
                let items = self.pop_mark()?;
                self.stack.push(Value::List(Rc::new(RefCell::new(items))));
            }
            b'a' => {
                let v = self.pop()?;
                self.append(vec![v])?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.append(items)?;
            }
            b'}' => self.stack.push(Value::Dict(Default::default())),
            b'd' => {
                let items = pairs(self.pop_mark()?)?;
                self.stack.push(Value::Dict(Rc::new(RefCell::new(items))));
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![(k, v)])?;
            }
            b'u' => {
                let items = pairs(self.pop_mark()?)?;
                self.set_items(items)?;
            }
            _ => return self.calls(op),
        }
        Ok(false)
    }

    /// The opcodes that name globals, make calls and use the memo.
    fn calls(&mut self, op: u8) -> Result<bool> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(module, name)?;
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (module, name) {
                    (Value::Str(m), Value::Str(n)) => self.global(&m, &n)?,
                    _ => bail!("STACK_GLOBAL of values that are not strings"),
                }
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let callable = self.pop()?;
                ensure!(
                    matches!(callable, Value::Global(_)),
                    "it calls {}, not a global",
                    callable.kind()
                );
                self.stack.push(Value::Object(Rc::new(RefCell::new(Object {
                    callable,
                    args,
                    state: None,
                    items: Vec::new(),
                }))));
            }
            b'b' => {
                let state = self.pop()?;
                match self.top()? {
                    Value::Object(o) => o.borrow_mut().state = Some(state),
                    other => bail!("BUILD on {}", other.kind()),
                }
            }
            b'Q' => {
                let id = self.pop()?;
                self.stack.push(Value::Persistent(Rc::new(id)));
            }
            b'q' => {
                let key = self.u8()?.into();
                self.memo_put(key)?;
            }
            b'r' => {
                let key = self.u32()?.into();
                self.memo_put(key)?;
            }
            0x94 => {
                let key = self.memo.len() as u64;
                self.memo_put(key)?;
            }
            b'h' => {
                let key = self.u8()?.into();
                self.memo_get(key)?;
            }
            b'j' => {
                let key = self.u32()?.into();
                self.memo_get(key)?;
            }
            other => bail!(
                "opcode 0x{other:02x} ('{}'), which a torch checkpoint does not use",
                (other as char).escape_default()
            ),
        }
        Ok(false)
    }

    fn append(&mut self, items: Vec<Value>) -> Result<()> {
        match self.top()? {
            Value::List(l) => l.borrow_mut().extend(items),
            other => bail!("APPEND to {}", other.kind()),
        }
        Ok(())
    }

    fn set_items(&mut self, items: Vec<(Value, Value)>) -> Result<()> {
        match self.top()? {
            Value::Dict(d) => d.borrow_mut().extend(items),
            // An OrderedDict() built by a call, then filled.
            Value::Object(o) => o.borrow_mut().items.extend(items),
            other => bail!("SETITEM on {}", other.kind()),
        }
        Ok(())
    }
}

/// Keys and values, alternating, as pairs.
fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>> {
    ensure!(
        items.len().is_multiple_of(2),
        "a dict of an odd number of items"
    );
    let mut it = items.into_iter();
    let mut out = Vec::new();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// A LONG1/LONG4 integer: little-endian two's complement, at most 8 bytes.
fn long(bytes: &[u8]) -> Result<i64> {
    ensure!(bytes.len() <= 8, "an integer of {} bytes", bytes.len());
    if bytes.is_empty() {
        return Ok(0);
    }
    let fill = if bytes[bytes.len() - 1] & 0x80 != 0 {
        0xff
    } else {
        0
    };
    let mut full = [fill; 8];
    full[..bytes.len()].copy_from_slice(bytes);
    Ok(i64::from_le_bytes(full))
}

#[cfg(test)]
mod tests;
