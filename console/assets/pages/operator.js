// For the operator: how far the projection and the relay trail the ledger, the dead-letter
// queue, and an incremental verification of the hash chain.

import { api } from '../api.js';
import { figures, h, notice, section, term, time } from '../dom.js';

function refusal(error) {
  return notice(error.code || 'error', error.message || String(error));
}

export async function render({ view }) {
  view.append(h('h1', {}, 'Operator'));
  const status = section('Ledger, projection, relay');
  const verify = section('Verification');
  view.append(status, verify);
  await Promise.all([
    loadStatus(status).catch((error) => status.append(refusal(error))),
    loadVerify(verify).catch((error) => verify.append(refusal(error))),
  ]);
}

async function loadStatus(element) {
  const answer = await api('/v1/status');
  const { ledger = {}, projection = {}, relay = {}, dlq = {} } = answer;
  const unknown = 'unknown (NATS did not answer)';
  element.append(figures(
    term('Ledger head', 'head_position', ledger.head_position),
    term('Head recorded', 'head_recorded_at', ledger.head_recorded_at, time(ledger.head_recorded_at)),
    term('Projection at', 'position', projection.position),
    term('Projection lag (events)', 'projection_lag_events', projection.lag_events),
    term('Relay published up to', 'relay_stream_last_position', relay.stream_last_position, relay.stream_last_position ?? unknown),
    term('Relay lag (events)', 'relay_lag_events', relay.lag_events, relay.lag_events ?? unknown),
    term('Dead-letter messages', 'dlq_messages', dlq.messages, dlq.messages ?? unknown),
  ));
}

async function loadVerify(element) {
  const button = h('button', { id: 'verify-run', type: 'button' }, 'Verify again');
  const result = h('div');
  const run = async () => {
    button.disabled = true;
    try {
      const answer = await api('/v1/ledger/verify');
      result.replaceChildren(figures(
        term('Chain intact', 'verify_ok', answer.ok, answer.ok ? 'yes' : 'NO'),
        term('Events checked', 'events_checked', answer.events_checked),
        term('Head position', 'verify_head_position', answer.head_position),
        term('First bad position', 'first_bad_position', answer.first_bad_position),
      ));
    } finally {
      button.disabled = false;
    }
  };
  element.append(h('p', {}, 'Checks the hash chain from the last verified checkpoint (incremental).'), result, button);
  button.addEventListener('click', () => run().catch((error) => result.replaceChildren(refusal(error))));
  await run();
}
