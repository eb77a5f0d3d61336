// The ledger itself, event by event: filtered by org, container and type, a page at a
// time. The next page is an address (`after=`), so any page can be pasted.

import { api, query } from '../api.js';
import { address, h, notice, section, shortHex, time } from '../dom.js';

/** Events per page. */
const AUDIT_PAGE = 100;
const TYPES = [
  'container.created', 'container.command_ran', 'container.stopped', 'container.resumed', 'container.port_published',
  'org.plan_changed', 'org.verification_changed', 'org.billing_eligibility_changed', 'plan.defined',
];

export async function render({ view, query: search, navigate }) {
  const filters = {
    org_id: search.get('org_id') || '',
    container_id: search.get('container_id') || '',
    type: search.get('type') || '',
  };
  const after = search.get('after') || '';
  view.append(h('h1', {}, 'Audit'), auditForm(filters, navigate));
  const results = section('Events');
  view.append(results);
  try {
    const answer = await api(`/v1/events${query({ ...filters, after, limit: AUDIT_PAGE })}`);
    const rows = answer.events.map((event) => h(
      'tr',
      { dataset: { position: event.position, hash: event.hash, type: event.type } },
      h('th', { scope: 'row' }, String(event.position)),
      h('td', {}, time(event.occurred_at)),
      h('td', {}, time(event.recorded_at)),
      h('td', {}, event.type),
      h('td', {}, event.org_id ? h('a', { href: `/console/orgs/${encodeURIComponent(event.org_id)}` }, event.org_id) : '—'),
      h('td', {}, event.container_id
        ? h('a', { href: address(`/console/containers/${encodeURIComponent(event.container_id)}`, { org_id: event.org_id }) }, event.container_id)
        : '—'),
      h('td', {}, h('code', { class: 'data', title: JSON.stringify(event.data ?? {}) }, JSON.stringify(event.data ?? {}))),
      h('td', {}, shortHex(event.hash)),
    ));
    const first = answer.events[0]?.position;
    const last = answer.events.at(-1)?.position;
    results.append(
      h('p', {}, answer.events.length
        ? `Positions ${first} to ${last}${after ? `, after ${after}` : ''}.`
        : `No events${after ? ` after position ${after}` : ''} match.`),
      h('div', { class: 'table-scroll' },
        h('table', { id: 'audit-events' },
          h('caption', {}, 'Ledger events in position order'),
          h('thead', {}, h('tr', {}, ['Position', 'Occurred', 'Recorded', 'Type', 'Org', 'Container', 'Data', 'Hash']
            .map((text) => h('th', { scope: 'col' }, text)))),
          h('tbody', {}, rows))),
      h('nav', { class: 'pager', 'aria-label': 'Pages of events' },
        after ? h('a', { href: address('/console/audit', filters) }, '⇤ First page') : null,
        answer.events.length === AUDIT_PAGE
          ? h('a', { id: 'audit-next', href: address('/console/audit', { ...filters, after: answer.next_after }) }, 'Next page →')
          : null),
    );
  } catch (error) {
    results.append(notice(error.code || 'error', error.message));
  }
}

function auditForm(filters, navigate) {
  const input = (id, name, label, value, extra = {}) => [
    h('label', { for: id }, label),
    h('input', { id, name, value, autocomplete: 'off', ...extra }),
  ];
  const form = h(
    'form',
    { id: 'audit-form', class: 'inline' },
    input('audit-org', 'org_id', 'Org', filters.org_id),
    input('audit-container', 'container_id', 'Container', filters.container_id),
    input('audit-type', 'type', 'Type', filters.type, { list: 'event-types' }),
    h('datalist', { id: 'event-types' }, TYPES.map((type) => h('option', { value: type }))),
    h('button', { type: 'submit' }, 'Search'),
  );
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const data = new FormData(form);
    navigate(address('/console/audit', {
      org_id: String(data.get('org_id')).trim(),
      container_id: String(data.get('container_id')).trim(),
      type: String(data.get('type')).trim(),
    }));
  });
  return form;
}
