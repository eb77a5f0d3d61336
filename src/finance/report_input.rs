//! The bytes of a provider report on their way from the client (an HTTP body, a file) to
//! the CSV reader, on the import's blocking task: chunks handed over from async code,
//! inflated when the report is gzip, then counted and hashed as the report's CSV text.
//!
//! Inflating streams through `flate2` a buffer at a time, so memory stays a few buffers
//! whatever the report's size; the inflated size has a limit of its own, so that a small
//! body cannot inflate without end. The report's identity is the sha256 of the CSV text,
//! not of the bytes sent: the same report gzipped and plain is one report.

use std::io::Read;

use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

/// The first bytes of every gzip member (RFC 1952).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// How a report's bytes are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// CSV text as it is.
    Plain,
    /// Gzip (one member or several, as `gzip` writes them) around CSV text.
    Gzip,
    /// Gzip when the bytes begin as gzip does, else CSV text: for a file whose name does
    /// not say.
    Detect,
}

/// Why a report's bytes could not be read to their end.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("the report is larger than {0} bytes")]
    TooLarge(u64),
    #[error("the report inflates to more than {0} bytes")]
    InflatedTooLarge(u64),
    #[error("the report is not valid gzip: {0}")]
    Gzip(String),
    #[error("reading the report failed: {0}")]
    Read(String),
}

/// A `Read` over the chunks sent from async code.
pub struct ChunkReader {
    chunks: mpsc::Receiver<Result<bytes::Bytes, InputError>>,
    current: bytes::Bytes,
}

impl ChunkReader {
    pub fn new(chunks: mpsc::Receiver<Result<bytes::Bytes, InputError>>) -> ChunkReader {
        ChunkReader {
            chunks,
            current: bytes::Bytes::new(),
        }
    }

    /// Takes the next chunk into `current`, after what it holds; `false` at the end.
    fn receive(&mut self) -> std::io::Result<bool> {
        match self.chunks.blocking_recv() {
            None => Ok(false),
            Some(Ok(chunk)) if self.current.is_empty() => {
                self.current = chunk;
                Ok(true)
            }
            Some(Ok(chunk)) => {
                let mut joined = bytes::BytesMut::from(&self.current[..]);
                joined.extend_from_slice(&chunk);
                self.current = joined.freeze();
                Ok(true)
            }
            Some(Err(error)) => Err(std::io::Error::other(error)),
        }
    }

    /// Whether the bytes begin with `prefix`, reading none of them away.
    fn starts_with(&mut self, prefix: &[u8]) -> std::io::Result<bool> {
        while self.current.len() < prefix.len() {
            if !self.receive()? {
                break;
            }
        }
        Ok(self.current.starts_with(prefix))
    }
}

impl Read for ChunkReader {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            if !self.receive()? {
                return Ok(0);
            }
        }
        let n = buffer.len().min(self.current.len());
        buffer[..n].copy_from_slice(&self.current[..n]);
        self.current = self.current.slice(n..);
        Ok(n)
    }
}

/// The report's CSV text: the chunks, inflated when they are gzip, hashed and counted as
/// they are read.
pub struct CsvText {
    inner: Box<dyn Read + Send>,
    gzip: bool,
    hasher: Sha256,
    read_bytes: u64,
    /// The inflated size limit; `None` for plain text (the chunks' own limit holds).
    max_bytes: Option<u64>,
}

impl CsvText {
    /// The text of `chunks` in `encoding`; inflated text past `max_inflated_bytes` fails
    /// with [`InputError::InflatedTooLarge`].
    pub fn new(
        mut chunks: ChunkReader,
        encoding: Encoding,
        max_inflated_bytes: u64,
    ) -> Result<CsvText, InputError> {
        let gzip = match encoding {
            Encoding::Plain => false,
            Encoding::Gzip => true,
            Encoding::Detect => chunks
                .starts_with(&GZIP_MAGIC)
                .map_err(|error| input_error(error, false))?,
        };
        let inner: Box<dyn Read + Send> = if gzip {
            Box::new(flate2::read::MultiGzDecoder::new(chunks))
        } else {
            Box::new(chunks)
        };
        Ok(CsvText {
            inner,
            gzip,
            hasher: Sha256::new(),
            read_bytes: 0,
            max_bytes: gzip.then_some(max_inflated_bytes),
        })
    }

    /// The sha256 of the whole text; reads what is left of it first.
    pub fn finish(mut self) -> Result<[u8; 32], InputError> {
        let mut rest = Vec::new();
        self.read_to_end(&mut rest)
            .map_err(|error| self.error(error))?;
        Ok(self.hasher.finalize().into())
    }

    /// An input error of this text's reading as what it is: one of ours, carried through
    /// the readers, or the inflater's refusal of the bytes.
    pub fn error(&self, error: std::io::Error) -> InputError {
        input_error(error, self.gzip)
    }
}

impl Read for CsvText {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        let read = self.inner.read(buffer)?;
        self.read_bytes += read as u64;
        if let Some(max) = self.max_bytes.filter(|max| self.read_bytes > *max) {
            return Err(std::io::Error::other(InputError::InflatedTooLarge(max)));
        }
        self.hasher.update(&buffer[..read]);
        Ok(read)
    }
}

/// An I/O error from the readers: an [`InputError`] carried inside it as it was made, or
/// else the gzip decoder's refusal of the bytes (or, without gzip, a failed read).
fn input_error(error: std::io::Error, gzip: bool) -> InputError {
    if error
        .get_ref()
        .is_some_and(|inner| inner.is::<InputError>())
    {
        let inner = error
            .into_inner()
            .expect("the error carries an inner error");
        return *inner
            .downcast::<InputError>()
            .expect("the inner error was seen to be an input error");
    }
    if gzip {
        InputError::Gzip(error.to_string())
    } else {
        InputError::Read(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn gzipped(text: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(text).unwrap();
        encoder.finish().unwrap()
    }

    /// The text of `bytes` sent as chunks of `chunk_bytes`, and its sha256, or the error.
    fn read(
        bytes: &[u8],
        chunk_bytes: usize,
        encoding: Encoding,
        max_inflated_bytes: u64,
    ) -> Result<(Vec<u8>, [u8; 32]), InputError> {
        let chunks: Vec<bytes::Bytes> = bytes
            .chunks(chunk_bytes)
            .map(bytes::Bytes::copy_from_slice)
            .collect();
        let (sender, receiver) = mpsc::channel(chunks.len().max(1));
        for chunk in chunks {
            sender.try_send(Ok(chunk)).unwrap();
        }
        drop(sender);
        let mut text = CsvText::new(ChunkReader::new(receiver), encoding, max_inflated_bytes)?;
        let mut read = Vec::new();
        text.read_to_end(&mut read)
            .map_err(|error| text.error(error))?;
        Ok((read, text.finish()?))
    }

    #[test]
    fn gzip_and_plain_text_read_the_same_and_hash_the_same() {
        let text = "a,b\n1,2\n".repeat(1_000);
        let plain = read(text.as_bytes(), 7, Encoding::Plain, 10).unwrap();
        assert_eq!(plain.0, text.as_bytes());
        assert_eq!(plain.1, <[u8; 32]>::from(Sha256::digest(text.as_bytes())));
        for encoding in [Encoding::Gzip, Encoding::Detect] {
            // A one-byte first chunk: detection must look past it.
            let inflated = read(&gzipped(text.as_bytes()), 1, encoding, 1 << 20).unwrap();
            assert_eq!(inflated, plain, "{encoding:?}");
        }
        assert_eq!(
            read(text.as_bytes(), 1, Encoding::Detect, 10).unwrap(),
            plain
        );
    }

    #[test]
    fn several_gzip_members_are_read_as_one_text() {
        let mut bytes = gzipped(b"a,b\n");
        bytes.extend(gzipped(b"1,2\n"));
        let (text, _) = read(&bytes, 3, Encoding::Gzip, 100).unwrap();
        assert_eq!(text, b"a,b\n1,2\n");
    }

    #[test]
    fn gzip_past_the_inflated_limit_fails_as_too_large() {
        let bomb = gzipped(&vec![b'0'; 1 << 20]);
        assert!(bomb.len() < 10_000, "{} compressed bytes", bomb.len());
        let error = read(&bomb, 4096, Encoding::Gzip, 100_000).unwrap_err();
        assert!(
            matches!(error, InputError::InflatedTooLarge(100_000)),
            "{error:?}"
        );
        assert!(read(&bomb, 4096, Encoding::Gzip, 1 << 20).is_ok());
    }

    #[test]
    fn bytes_that_are_not_gzip_fail_as_gzip() {
        let mut corrupt = gzipped("a,b\n1,2\n".repeat(100).as_bytes());
        let middle = corrupt.len() / 2;
        corrupt[middle..].iter_mut().for_each(|byte| *byte ^= 0x55);
        let truncated = &gzipped(b"a,b\n1,2\n")[..12];
        for bytes in [&corrupt[..], truncated, &b"a,b\n1,2\n"[..]] {
            let error = read(bytes, 5, Encoding::Gzip, 1 << 20).unwrap_err();
            assert!(matches!(error, InputError::Gzip(_)), "{error:?}");
        }
    }

    #[test]
    fn an_error_of_the_chunks_comes_through_the_inflater_as_it_was() {
        let (sender, receiver) = mpsc::channel(2);
        sender
            .try_send(Ok(bytes::Bytes::from(gzipped(b"a,b\n"))))
            .unwrap();
        sender.try_send(Err(InputError::TooLarge(7))).unwrap();
        drop(sender);
        let mut text = CsvText::new(ChunkReader::new(receiver), Encoding::Gzip, 100).unwrap();
        let mut read = Vec::new();
        let error = text.read_to_end(&mut read).unwrap_err();
        assert!(matches!(text.error(error), InputError::TooLarge(7)));
    }
}
