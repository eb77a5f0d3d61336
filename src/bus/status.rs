//! What the streams hold, for the operator's status (`GET /v1/status`): the ledger position
//! of the last message the relay published to `TALLY_LEDGER`, and the messages waiting in
//! `TALLY_DLQ`.

use async_nats::jetstream;

use super::check::ledger_stream;
use super::{Names, StreamFailure, POSITION_HEADER};

/// The ledger position of `TALLY_LEDGER`'s last message, read from its `Tally-Position`
/// header (a seeded stream's sequences are not positions); 0 while the stream is empty.
pub async fn ledger_stream_last_position(
    context: &jetstream::Context,
    names: &Names,
) -> Result<i64, StreamFailure> {
    let (stream, state) = ledger_stream(context, names).await?;
    if state.messages == 0 {
        return Ok(0);
    }
    let message =
        stream
            .get_raw_message(state.last_sequence)
            .await
            .map_err(StreamFailure::doing(format!(
                "reading stream message {}",
                state.last_sequence
            )))?;
    message
        .headers
        .get(POSITION_HEADER)
        .and_then(|value| value.as_str().parse::<i64>().ok())
        .ok_or_else(|| {
            StreamFailure::new(format!(
                "stream message {} has no {POSITION_HEADER}",
                state.last_sequence
            ))
        })
}

/// The messages `TALLY_DLQ` holds.
pub async fn dlq_messages(
    context: &jetstream::Context,
    names: &Names,
) -> Result<u64, StreamFailure> {
    let mut stream = context
        .get_stream(names.dlq_stream())
        .await
        .map_err(StreamFailure::doing("cannot find the dead-letter stream"))?;
    let info = stream.info().await.map_err(StreamFailure::doing(
        "reading the dead-letter stream's state",
    ))?;
    Ok(info.state.messages)
}
