//! Bounds-checked parsing of the GGUF container (versions 2 and 3, little-endian).
//!
//! # File layout
//!
//! ```text
//! magic        4 bytes  "GGUF"
//! version      u32      2 or 3 (identical layouts; v3 merely allowed big-endian files,
//!                       which are refused here; v1 used u32 counts and is refused)
//! n_tensors    u64
//! n_kv         u64
//! n_kv × { key: string, value_type: u32, value }
//! n_tensors × { name: string, n_dims: u32 (1..=4), ne: [u64; n_dims], ggml_type: u32,
//!               offset: u64 (relative to the data section, a multiple of the alignment) }
//! padding to `general.alignment` (default 32)
//! data section: tensor bytes; element (i0, i1, ..) at i0 + ne0·(i1 + ne1·(..)), i.e. ne[0]
//!               is the contiguous (innermost) dimension, the reverse of PyTorch's shape order.
//!
//! string = u64 byte length + UTF-8 bytes (no terminator)
//! value  = by value_type: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool (1 byte),
//!          8 string, 9 array { elem_type: u32, count: u64, count × value }, 10 u64, 11 i64,
//!          12 f64
//! ```
//!
//! # Robustness contract
//! Every length, count and offset read from the file is checked against the bytes that are
//! actually there, with checked arithmetic, before anything is allocated or sliced: a truncated
//! or fuzzed file yields an [`Error::Format`] naming the file, never a panic, and allocations
//! are bounded by a small multiple of the file size. Nested arrays are limited to
//! [`MAX_ARRAY_DEPTH`] levels so a hostile file cannot exhaust the stack.

use crate::dtype::DType;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// Default alignment of the data section and of each tensor's offset.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Deepest nesting of arrays accepted in metadata (real files use 1).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// GGML's maximum number of tensor dimensions.
pub const MAX_DIMS: usize = 4;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: homogeneous, stored unboxed per element type so that a 49152-entry token
/// list costs one `Vec<String>`, not 49152 enum values.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    /// Any integer value that fits in `u64` (negative values give `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(x) => Some(x.into()),
            GgufValue::U16(x) => Some(x.into()),
            GgufValue::U32(x) => Some(x.into()),
            GgufValue::U64(x) => Some(x),
            GgufValue::I8(x) => u64::try_from(x).ok(),
            GgufValue::I16(x) => u64::try_from(x).ok(),
            GgufValue::I32(x) => u64::try_from(x).ok(),
            GgufValue::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }
    /// Any numeric value as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(x) => Some(x.into()),
            GgufValue::F64(x) => Some(x),
            GgufValue::I8(x) => Some(x.into()),
            GgufValue::I16(x) => Some(x.into()),
            GgufValue::I32(x) => Some(x.into()),
            GgufValue::I64(x) => Some(x as f64),
            _ => self.as_u64().map(|x| x as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }
}

impl GgufArray {
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }
    /// Integer arrays of any width as `i64` (u64 values above `i64::MAX` give `None`).
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        Some(match self {
            GgufArray::U8(v) => v.iter().map(|&x| x.into()).collect(),
            GgufArray::I8(v) => v.iter().map(|&x| x.into()).collect(),
            GgufArray::U16(v) => v.iter().map(|&x| x.into()).collect(),
            GgufArray::I16(v) => v.iter().map(|&x| x.into()).collect(),
            GgufArray::U32(v) => v.iter().map(|&x| x.into()).collect(),
            GgufArray::I32(v) => v.iter().map(|&x| x.into()).collect(),
            GgufArray::I64(v) => v.clone(),
            GgufArray::U64(v) => v
                .iter()
                .map(|&x| i64::try_from(x).ok())
                .collect::<Option<_>>()?,
            _ => return None,
        })
    }
    /// Numeric arrays as `f32`.
    pub fn to_f32s(&self) -> Option<Vec<f32>> {
        match self {
            GgufArray::F32(v) => Some(v.clone()),
            GgufArray::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => self
                .to_i64s()
                .map(|v| v.into_iter().map(|x| x as f32).collect()),
        }
    }
    /// The GGUF name of the element type.
    pub fn elem_type_name(&self) -> &'static str {
        match self {
            GgufArray::U8(_) => "u8",
            GgufArray::I8(_) => "i8",
            GgufArray::U16(_) => "u16",
            GgufArray::I16(_) => "i16",
            GgufArray::U32(_) => "u32",
            GgufArray::I32(_) => "i32",
            GgufArray::F32(_) => "f32",
            GgufArray::Bool(_) => "bool",
            GgufArray::String(_) => "string",
            GgufArray::Array(_) => "array",
            GgufArray::U64(_) => "u64",
            GgufArray::I64(_) => "i64",
            GgufArray::F64(_) => "f64",
        }
    }
}

/// One entry of the tensor table, checked against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `ne[0]` is the contiguous dimension (reverse of the PyTorch shape).
    pub ne: Vec<usize>,
    pub dtype: DType,
    /// Absolute byte offset of the tensor's data in the file.
    pub start: usize,
    /// Byte length of the tensor's data.
    pub n_bytes: usize,
}

impl TensorInfo {
    /// Shape in PyTorch / Hugging Face order (outermost first): `ne` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().copied().collect()
    }
    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.ne.iter().product()
    }
}

/// The parsed header, metadata and tensor table of a GGUF file.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: usize,
    /// Absolute offset of the data section.
    pub data_offset: usize,
}

/// ggml's name of any type id it assigned, supported or not (its registry, for error
/// messages; `None` for ids ggml never assigned). The supported types are [`DType`]'s.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        4 => "Q4_2",
        5 => "Q4_3",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        31 => "Q4_0_4_4",
        32 => "Q4_0_4_8",
        33 => "Q4_0_8_8",
        34 => "TQ1_0",
        35 => "TQ2_0",
        36 => "IQ4_NL_4_4",
        37 => "IQ4_NL_4_8",
        38 => "IQ4_NL_8_8",
        39 => "MXFP4",
        _ => return None,
    })
}

/// The [`DType`] of a ggml type id, if supported (every [`DType`] carries its id:
/// [`DType::ggml_id`]).
pub fn dtype_from_ggml(id: u32) -> Option<DType> {
    DType::from_ggml_id(id)
}

/// The ggml type id of a [`DType`] (inverse of [`dtype_from_ggml`]).
pub fn ggml_id(dtype: DType) -> u32 {
    dtype.ggml_id()
}

/// The supported types' names, for error messages: `"F32, F16, BF16, Q4_0, …"`.
fn supported_types() -> String {
    DType::ALL.map(DType::name).join(", ")
}

/// Value type ids (the `value_type` field).
mod vt {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Fewest bytes one value of type `t` can occupy in the file (used to reject counts that
/// cannot fit before allocating for them).
fn min_size(t: u32) -> usize {
    match t {
        vt::U8 | vt::I8 | vt::BOOL => 1,
        vt::U16 | vt::I16 => 2,
        vt::U32 | vt::I32 | vt::F32 => 4,
        vt::STRING | vt::U64 | vt::I64 | vt::F64 => 8,
        vt::ARRAY => 12,
        _ => 1,
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::format(self.path, msg)
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!(
                "truncated: {} at byte {} needs {} bytes but the file has {} bytes",
                what(),
                self.pos,
                n,
                self.buf.len()
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count or length, checked to fit `usize`.
    fn len(&mut self, what: &dyn Fn() -> String) -> Result<usize> {
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| self.err(format!("{}: length {n} is too large", what())))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.err(format!("{} is not valid UTF-8", what())))
    }

    fn value(&mut self, t: u32, what: &dyn Fn() -> String, depth: usize) -> Result<GgufValue> {
        Ok(match t {
            vt::U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            vt::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            vt::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            vt::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            vt::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            vt::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            vt::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            vt::BOOL => GgufValue::Bool(self.array::<1>(what)?[0] != 0),
            vt::STRING => GgufValue::String(self.string(what)?),
            vt::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            vt::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            vt::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            vt::ARRAY => GgufValue::Array(self.array_value(what, depth + 1)?),
            other => return Err(self.err(format!("{}: unknown value type {other}", what()))),
        })
    }

    fn array_value(&mut self, what: &dyn Fn() -> String, depth: usize) -> Result<GgufArray> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.err(format!(
                "{}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels",
                what()
            )));
        }
        let t = self.u32(what)?;
        if t > vt::F64 {
            return Err(self.err(format!("{}: unknown array element type {t}", what())));
        }
        let n = self.len(what)?;
        // Reject a count that cannot fit before allocating for it.
        if n.checked_mul(min_size(t))
            .is_none_or(|b| b > self.remaining())
        {
            return Err(self.err(format!(
                "truncated: {} declares {n} elements but only {} bytes remain",
                what(),
                self.remaining()
            )));
        }
        macro_rules! prim {
            ($variant:ident, $ty:ty) => {{
                let size = std::mem::size_of::<$ty>();
                let bytes = self.take(n * size, what)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact(size)
                        .map(|c| {
                            let mut a = [0u8; std::mem::size_of::<$ty>()];
                            a.copy_from_slice(c);
                            <$ty>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match t {
            vt::U8 => GgufArray::U8(self.take(n, what)?.to_vec()),
            vt::I8 => prim!(I8, i8),
            vt::U16 => prim!(U16, u16),
            vt::I16 => prim!(I16, i16),
            vt::U32 => prim!(U32, u32),
            vt::I32 => prim!(I32, i32),
            vt::F32 => prim!(F32, f32),
            vt::U64 => prim!(U64, u64),
            vt::I64 => prim!(I64, i64),
            vt::F64 => prim!(F64, f64),
            vt::BOOL => GgufArray::Bool(self.take(n, what)?.iter().map(|&b| b != 0).collect()),
            vt::STRING => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("{}[{i}]", what()))?);
                }
                GgufArray::String(v)
            }
            _ => {
                // vt::ARRAY
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.array_value(&|| format!("{}[{i}]", what()), depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

/// Parses the header, metadata and tensor table of `buf` and checks every tensor against the
/// file (supported type, whole blocks per row, aligned offset, data inside the file).
pub fn parse(buf: &[u8], path: &Path) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0, path };
    let version = header(&mut c)?;
    let n_tensors = c.len(&|| "tensor count".into())?;
    let n_kv = c.len(&|| "metadata count".into())?;
    let metadata = metadata(&mut c, n_kv)?;
    let alignment = alignment(&c, &metadata)?;
    let raw = tensor_infos(&mut c, n_tensors)?;
    let data_offset = c
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| c.err("data section offset overflows"))?;
    let mut tensors = Vec::with_capacity(raw.len());
    let mut seen = std::collections::HashSet::new();
    for r in raw {
        if !seen.insert(r.name.clone()) {
            return Err(c.err(format!("duplicate tensor name '{}'", r.name)));
        }
        tensors.push(place_tensor(&c, r, alignment, data_offset)?);
    }
    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// The magic bytes and a supported version (returned).
fn header(c: &mut Cursor<'_>) -> Result<u32> {
    let magic = c.take(4, &|| "magic".into())?;
    if magic != b"GGUF" {
        return Err(c.err(format!(
            "not a GGUF file (magic bytes {magic:02x?}, expected \"GGUF\")"
        )));
    }
    let version = c.u32(&|| "version".into())?;
    match version {
        2 | 3 => Ok(version),
        1 => Err(c.err("GGUF version 1 is not supported (supported: 2, 3)")),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => Err(c.err(format!(
            "big-endian GGUF (version {}) is not supported: only little-endian files",
            v.swap_bytes()
        ))),
        v => Err(c.err(format!("unknown GGUF version {v} (supported: 2, 3)"))),
    }
}

/// `n_kv` key/value pairs; keys are unique.
fn metadata(c: &mut Cursor<'_>, n_kv: usize) -> Result<BTreeMap<String, GgufValue>> {
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i} of {n_kv}"))?;
        let what = || format!("metadata '{key}'");
        let t = c.u32(&what)?;
        let value = c.value(t, &what, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(c.err(format!("duplicate metadata key '{key}'")));
        }
    }
    Ok(metadata)
}

/// `general.alignment` (a power of two), or the default.
fn alignment(c: &Cursor<'_>, metadata: &BTreeMap<String, GgufValue>) -> Result<usize> {
    match metadata.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(v) => match v.as_u64().and_then(|a| usize::try_from(a).ok()) {
            Some(a) if a.is_power_of_two() => Ok(a),
            _ => Err(c.err(format!(
                "general.alignment must be a power of two, got {v:?}"
            ))),
        },
    }
}

/// A tensor-table entry as read, before its type and bounds are checked.
struct RawInfo {
    name: String,
    ne: Vec<usize>,
    ggml_type: u32,
    offset: u64,
}

/// The `n_tensors` entries of the tensor table.
fn tensor_infos(c: &mut Cursor<'_>, n_tensors: usize) -> Result<Vec<RawInfo>> {
    let mut raw = Vec::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor info #{i} of {n_tensors} (name)"))?;
        let what = || format!("tensor info '{name}'");
        let n_dims = c.u32(&what)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.err(format!(
                "tensor '{name}' has {n_dims} dimensions (must be 1..={MAX_DIMS})"
            )));
        }
        let mut ne = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = c.u64(&what)?;
            let d = usize::try_from(d)
                .ok()
                .filter(|&d| d as u64 <= i64::MAX as u64)
                .ok_or_else(|| c.err(format!("tensor '{name}' has dimension {d}, too large")))?;
            ne.push(d);
        }
        let ggml_type = c.u32(&what)?;
        let offset = c.u64(&what)?;
        raw.push(RawInfo {
            name,
            ne,
            ggml_type,
            offset,
        });
    }
    Ok(raw)
}

/// A table entry checked: a supported type, whole blocks per row, an aligned offset, and
/// its bytes inside the file.
fn place_tensor(
    c: &Cursor<'_>,
    r: RawInfo,
    alignment: usize,
    data_offset: usize,
) -> Result<TensorInfo> {
    let dtype = dtype_from_ggml(r.ggml_type).ok_or_else(|| {
        let ty = ggml_type_name(r.ggml_type)
            .map(str::to_string)
            .unwrap_or_else(|| format!("#{} (unknown)", r.ggml_type));
        c.err(format!(
            "tensor '{}' has type {ty}, which is not supported (supported: {})",
            r.name,
            supported_types()
        ))
    })?;
    let n_elements =
        r.ne.iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| c.err(format!("tensor '{}': element count overflows", r.name)))?;
    if !r.ne[0].is_multiple_of(dtype.block_len()) {
        return Err(c.err(format!(
            "tensor '{}' ({dtype}) has rows of {} elements, not a multiple of the block size {}",
            r.name,
            r.ne[0],
            dtype.block_len()
        )));
    }
    let n_bytes = dtype
        .bytes_for(n_elements)
        .ok_or_else(|| c.err(format!("tensor '{}': byte size overflows", r.name)))?;
    if !r.offset.is_multiple_of(alignment as u64) {
        return Err(c.err(format!(
            "tensor '{}' has offset {} which is not a multiple of the alignment {alignment}",
            r.name, r.offset
        )));
    }
    let start = usize::try_from(r.offset)
        .ok()
        .and_then(|o| o.checked_add(data_offset));
    let end = start.and_then(|s| s.checked_add(n_bytes));
    let (Some(start), Some(end)) = (start, end) else {
        return Err(c.err(format!("tensor '{}': data offset overflows", r.name)));
    };
    if end > c.buf.len() {
        return Err(c.err(format!(
            "tensor '{}' data (bytes {start}..{end}) runs past the end of the file ({} bytes): truncated file?",
            r.name,
            c.buf.len()
        )));
    }
    Ok(TensorInfo {
        name: r.name,
        ne: r.ne,
        dtype,
        start,
        n_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip_and_match_the_names() {
        for dtype in DType::ALL {
            let id = ggml_id(dtype);
            assert_eq!(dtype_from_ggml(id), Some(dtype));
            assert_eq!(ggml_type_name(id), Some(dtype.name()));
        }
        assert_eq!(dtype_from_ggml(16), None); // IQ2_XXS: named, not supported
        assert_eq!(dtype_from_ggml(34), None); // TQ1_0
    }
}
