// A container: its figures, its life as a timeline (zoomed to a charge period when the
// address has from/to), a reconciliation line's figures beside the ledger's when the
// address has them, and its events from the ledger.

import { api, query } from '../api.js';
import { timeline } from '../timeline.js';
import {
  address, duration, figures, h, notice, section, shortHex, table, term, time, utcText,
} from '../dom.js';

/** Events read for the timeline at most; past this the page says it is truncated. */
const TIMELINE_EVENTS_MAX = 10_000;
/** Anomalies read at most, as for events. */
const ANOMALIES_MAX = 10_000;
/** The API's largest page. */
const API_PAGE = 1000;
/** Event rows added to the table at a time. */
const TABLE_PAGE = 100;

function instant(text) {
  if (!text) return null;
  const parsed = Date.parse(text);
  return Number.isFinite(parsed) ? parsed : null;
}

export async function render({ view, params, query: search }) {
  const [containerId] = params;
  const orgId = search.get('org_id') || undefined;
  const from = instant(search.get('from'));
  const to = instant(search.get('to'));
  const providerMs = search.get('provider_ms');
  const ledgerMs = search.get('ledger_ms');
  view.append(h('h1', {}, 'Container ', h('code', {}, containerId)));
  const path = `/v1/containers/${encodeURIComponent(containerId)}`;

  const [usage, events] = await Promise.all([
    readContainer(path, orgId).catch((error) => ({ error })),
    readEvents(path, orgId).catch((error) => ({ error })),
  ]);
  if (usage.error) {
    view.append(notice(usage.error.code || 'error', usage.error.message));
    return;
  }
  view.append(summary(usage, orgId));
  if (providerMs !== null || ledgerMs !== null) view.append(lineFigures(providerMs, ledgerMs, search));
  view.append(timelineSection(usage, events, { containerId, from, to, search }));
  view.append(intervalsSection(usage), anomaliesSection(usage));
  view.append(eventsSection(path, { containerId, orgId }, events));
}

/** The container's figures, with every anomaly (paged by the API, read up to a bound). */
async function readContainer(path, orgId) {
  const usage = await api(`${path}${query({ org_id: orgId, anomalies_limit: API_PAGE })}`);
  const anomalies = [...usage.anomalies];
  let after = usage.anomalies_next_after;
  while (after && anomalies.length < ANOMALIES_MAX) {
    const page = await api(`${path}${query({ org_id: orgId, anomalies_after: after, anomalies_limit: API_PAGE, min_position: usage.position })}`);
    anomalies.push(...page.anomalies);
    after = page.anomalies_next_after;
  }
  return { ...usage, anomalies, anomaliesTruncated: Boolean(after) };
}

/** The container's events in position order, up to TIMELINE_EVENTS_MAX. */
async function readEvents(path, orgId) {
  const list = [];
  let after = 0;
  let more = true;
  while (more && list.length < TIMELINE_EVENTS_MAX) {
    const page = await api(`${path}/events${query({ org_id: orgId, after, limit: API_PAGE })}`);
    list.push(...page.events);
    more = page.events.length === API_PAGE;
    after = page.next_after;
  }
  return { list, truncated: more, after };
}

function summary(usage, orgId) {
  const orgLink = usage.org_id ? h('a', { href: `/console/orgs/${encodeURIComponent(usage.org_id)}` }, usage.org_id) : '—';
  return section(
    'Figures',
    figures(
      term('Org', 'org_id', usage.org_id, orgLink),
      term('State', 'state', usage.state),
      term('Runtime', 'runtime_ms', usage.runtime_ms),
      term('Running intervals', 'intervals', usage.intervals.length),
      term('Anomalies', 'anomalies_total', usage.anomalies_total),
      term('Position', 'position', usage.position),
    ),
    orgId && usage.org_id && orgId !== usage.org_id ? notice('org_mismatch', `Asked for org ${orgId}, the ledger has ${usage.org_id}.`) : null,
  );
}

/** A reconciliation line's two figures, side by side. */
function lineFigures(providerMs, ledgerMs, search) {
  const number = (text) => (text === null || text === '' || Number.isNaN(Number(text)) ? null : Number(text));
  const provider = number(providerMs);
  const ledger = number(ledgerMs);
  const period = search.get('from') && search.get('to')
    ? h('p', {}, 'Charge period ', time(search.get('from')), ' to ', time(search.get('to')), '.')
    : null;
  return section(
    'Reconciliation line',
    period,
    figures(
      term('Provider runtime', 'provider_ms', provider),
      term('Ledger runtime', 'ledger_ms', ledger),
      h('div', {}, h('dt', {}, 'Provider − ledger'),
        h('dd', {}, provider !== null && ledger !== null ? `${provider - ledger} ms` : '—')),
    ),
  );
}

function timelineSection(usage, events, { containerId, from, to, search }) {
  const list = events.error ? [] : events.list;
  const box = h('div', { class: 'timeline-box' });
  const draw = () => box.replaceChildren(timeline({
    containerId,
    intervals: usage.intervals,
    anomalies: usage.anomalies,
    events: list,
    from,
    to,
    width: Math.max(320, Math.floor(box.getBoundingClientRect().width) || 960),
  }));
  draw();
  // Drawn again for the box's real width once it is in the page, and when that changes.
  let drawnWidth = 0;
  const observer = new ResizeObserver(([entry]) => {
    if (!box.isConnected) return observer.disconnect();
    const width = Math.floor(entry.contentRect.width);
    if (Math.abs(width - drawnWidth) > 8) {
      drawnWidth = width;
      draw();
    }
  });
  observer.observe(box);
  const zoomed = from !== null && to !== null;
  const whole = new URLSearchParams(search);
  whole.delete('from');
  whole.delete('to');
  const wholeText = whole.toString();
  return section(
    'Timeline',
    zoomed
      ? h('p', {}, `Zoomed to ${utcText(new Date(from).toISOString())} – ${utcText(new Date(to).toISOString())}. `,
        h('a', { href: `${location.pathname}${wholeText ? `?${wholeText}` : ''}` }, 'Show its whole life'))
      : null,
    box,
    h('p', { class: 'legend' },
      h('span', { class: 'key interval' }, 'running'), ' ',
      h('span', { class: 'key command' }, 'command'), ' ',
      h('span', { class: 'key failed' }, 'failed command'), ' ',
      h('span', { class: 'key port' }, 'port published'), ' ',
      h('span', { class: 'key anomaly' }, 'anomaly'), ' ',
      h('span', { class: 'key lifecycle' }, 'created / stopped / resumed'), ' · times in UTC'),
    events.error ? notice(events.error.code || 'error', `Commands, ports and lifecycle marks need the event log: ${events.error.message}`) : null,
    events.truncated ? notice('timeline_truncated', `The timeline shows the first ${events.list.length} events only.`) : null,
    usage.anomaliesTruncated ? notice('anomalies_truncated', `The first ${usage.anomalies.length} anomalies are shown.`) : null,
  );
}

function intervalsSection(usage) {
  const now = Date.now();
  const rows = usage.intervals.map((interval) => {
    const start = Date.parse(interval.start);
    const end = interval.end ? Date.parse(interval.end) : now;
    // A start dated ahead of the clock: the interval has not begun.
    const ahead = start > now;
    return h(
      'tr',
      { dataset: { start: interval.start, end: interval.end ?? '' } },
      h('td', {}, time(interval.start)),
      h('td', {}, interval.end ? time(interval.end) : ahead ? 'not started yet' : 'still running'),
      h('td', {}, ahead && !interval.end ? '—' : duration(end - start)),
    );
  });
  return section('Running intervals', table('intervals-table', 'Running intervals (open ones to now)', ['Start', 'End', 'Length'], rows));
}

function anomaliesSection(usage) {
  const rows = usage.anomalies.map((anomaly) =>
    h(
      'tr',
      { dataset: { kind: anomaly.kind, eventId: anomaly.event_id } },
      h('td', {}, anomaly.kind),
      h('td', {}, time(anomaly.occurred_at)),
      h('td', {}, h('code', {}, anomaly.event_id)),
    ));
  return section(
    'Anomalies',
    table('anomalies-table', 'Events the runtime rules set aside', ['Kind', 'Occurred', 'Event'], rows),
    rows.length === 0 ? h('p', {}, 'None.') : null,
  );
}

/** The event log, a hundred rows at a time; past what was read, further pages are asked for. */
function eventsSection(path, { containerId, orgId }, events) {
  if (events.error) return section('Events', notice(events.error.code || 'error', events.error.message));
  const tbody = h('tbody');
  const more = h('button', { id: 'events-more', type: 'button' }, 'More events');
  const state = { list: events.list, shown: 0, after: events.after, exhausted: !events.truncated };
  const showMore = () => {
    const next = state.list.slice(state.shown, state.shown + TABLE_PAGE);
    tbody.append(...next.map(eventRow));
    state.shown += next.length;
    more.hidden = state.shown >= state.list.length && state.exhausted;
  };
  more.addEventListener('click', async () => {
    if (state.shown >= state.list.length && !state.exhausted) {
      more.disabled = true;
      try {
        const page = await api(`${path}/events${query({ org_id: orgId, after: state.after, limit: API_PAGE })}`);
        state.list.push(...page.events);
        state.after = page.next_after;
        state.exhausted = page.events.length < API_PAGE;
      } catch (error) {
        more.replaceWith(notice(error.code || 'error', error.message));
        return;
      }
      more.disabled = false;
    }
    showMore();
  });
  showMore();
  return section(
    'Events',
    h('div', { class: 'table-scroll' },
      h('table', { id: 'container-events' },
        h('caption', {}, 'The ledger’s events of this container, in position order'),
        h('thead', {}, h('tr', {}, ['Position', 'Occurred', 'Recorded', 'Type', 'Data', 'Hash'].map((text) => h('th', { scope: 'col' }, text)))),
        tbody)),
    more,
    h('p', {}, h('a', { href: address('/console/audit', { container_id: containerId, org_id: orgId }) }, 'Open in the audit view')),
  );
}

export function eventRow(event) {
  return h(
    'tr',
    { dataset: { position: event.position, hash: event.hash, type: event.type } },
    h('td', {}, String(event.position)),
    h('td', {}, time(event.occurred_at)),
    h('td', {}, time(event.recorded_at)),
    h('td', {}, event.type),
    h('td', {}, h('code', { class: 'data', title: JSON.stringify(event.data ?? {}) }, JSON.stringify(event.data ?? {}))),
    h('td', {}, shortHex(event.hash)),
  );
}
