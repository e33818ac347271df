//! The byte encoding of saved states (docs/design.md §5, "Saved states"): little-endian
//! integers and floats (floats by their bit patterns, so every value round-trips exactly),
//! and vectors as a `u64` element count followed by the elements.
//!
//! [`Reader`] is the only way the decoder reads: every read checks the bytes that remain,
//! and [`Reader::vec`] checks a declared count against the most the cache configuration
//! allows **and** against the bytes that remain before it allocates, so no untrusted length
//! ever sizes an allocation. Its errors are [`Problem::Malformed`] and name what was read.

use super::{refuse, Problem};
use crate::error::Result;
use half::{bf16, f16};

/// A fixed-size value with a little-endian encoding.
pub(crate) trait Wire: Copy {
    /// Bytes of one encoded value.
    const SIZE: usize;
    fn put(self, out: &mut Vec<u8>);
    /// Decodes `SIZE` bytes.
    fn get(b: &[u8]) -> Self;
    /// Whether the value may appear in a state (floats: finite).
    fn valid(self) -> bool {
        true
    }
}

macro_rules! wire_int {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline]
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            #[inline]
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..Self::SIZE]);
                <$t>::from_le_bytes(a)
            }
        }
    )*};
}
wire_int!(u8, u16, u32, u64);

impl Wire for f32 {
    const SIZE: usize = 4;
    #[inline]
    fn put(self, out: &mut Vec<u8>) {
        self.to_bits().put(out)
    }
    #[inline]
    fn get(b: &[u8]) -> Self {
        f32::from_bits(u32::get(b))
    }
    fn valid(self) -> bool {
        self.is_finite()
    }
}

macro_rules! wire_half {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            const SIZE: usize = 2;
            #[inline]
            fn put(self, out: &mut Vec<u8>) {
                self.to_bits().put(out)
            }
            #[inline]
            fn get(b: &[u8]) -> Self {
                <$t>::from_bits(u16::get(b))
            }
            fn valid(self) -> bool {
                self.is_finite()
            }
        }
    )*};
}
wire_half!(f16, bf16);

/// Appends encoded values to a buffer.
#[derive(Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn put<T: Wire>(&mut self, x: T) {
        x.put(&mut self.buf)
    }
    pub(crate) fn usize(&mut self, x: usize) {
        (x as u64).put(&mut self.buf)
    }
    /// A vector: its element count (`u64`), then its elements.
    pub(crate) fn vec<T: Wire>(&mut self, v: &[T]) {
        self.usize(v.len());
        self.buf.reserve(v.len() * T::SIZE);
        for &x in v {
            x.put(&mut self.buf);
        }
    }
    /// A vector of `usize` values, each as `u64`.
    pub(crate) fn usizes(&mut self, v: &[usize]) {
        self.usize(v.len());
        for &x in v {
            self.usize(x);
        }
    }
}

/// Reads encoded values, checking every length (see the module docs).
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(refuse(
                Problem::Malformed,
                format!(
                    "{} needs {n} bytes but only {} remain",
                    what(),
                    self.remaining()
                ),
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub(crate) fn get<T: Wire>(&mut self, what: &dyn Fn() -> String) -> Result<T> {
        Ok(T::get(self.take(T::SIZE, what)?))
    }

    /// A `u64` that must fit `usize` and be at most `max`.
    pub(crate) fn usize(&mut self, max: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let x = self.get::<u64>(what)?;
        match usize::try_from(x) {
            Ok(x) if x <= max => Ok(x),
            _ => Err(refuse(
                Problem::Malformed,
                format!("{} is {x}, more than the {max} this state allows", what()),
            )),
        }
    }

    /// A vector of at most `max` elements, each [`Wire::valid`]. The count is checked
    /// against `max` and against the bytes that remain before anything is allocated.
    pub(crate) fn vec<T: Wire>(&mut self, max: usize, what: &dyn Fn() -> String) -> Result<Vec<T>> {
        let n = self.count(max, T::SIZE, what)?;
        let bytes = self.take(n * T::SIZE, what)?;
        let v: Vec<T> = bytes.chunks_exact(T::SIZE).map(T::get).collect();
        if let Some(i) = v.iter().position(|x| !x.valid()) {
            return Err(refuse(
                Problem::Malformed,
                format!("{} holds a non-finite value at element {i}", what()),
            ));
        }
        Ok(v)
    }

    /// A vector of at most `max` `usize` values (each a `u64`).
    pub(crate) fn usizes(&mut self, max: usize, what: &dyn Fn() -> String) -> Result<Vec<usize>> {
        let v = self.vec::<u64>(max, what)?;
        v.into_iter()
            .map(|x| {
                usize::try_from(x).map_err(|_| {
                    refuse(
                        Problem::Malformed,
                        format!("{} holds {x}, too large here", what()),
                    )
                })
            })
            .collect()
    }

    /// An element count of at most `max` whose `size`-byte elements fit in what remains.
    fn count(&mut self, max: usize, size: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let n = self.get::<u64>(what)?;
        let fits = usize::try_from(n)
            .ok()
            .filter(|&n| n <= max)
            .filter(|&n| n.checked_mul(size).is_some_and(|b| b <= self.remaining()));
        fits.ok_or_else(|| {
            refuse(
                Problem::Malformed,
                format!(
                    "{} declares {n} elements: at most {max} allowed here, and {} bytes remain",
                    what(),
                    self.remaining()
                ),
            )
        })
    }

    /// Refuses bytes left after the last section.
    pub(crate) fn finish(&self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(refuse(
                Problem::Malformed,
                format!("{n} bytes follow the last section"),
            )),
        }
    }
}
