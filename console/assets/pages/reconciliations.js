// Provider reports and the reconciliations made of them; one reconciliation with its counts,
// money totals and lines (filtered, sorted and paged by the API; the address holds all
// three, so a view can be pasted). Each line links to its container's timeline, zoomed to
// the line's charge period with both runtimes beside each other.

import { api, query } from '../api.js';
import {
  address, cell, figure, figures, h, notice, section, shortHex, table, term, time,
} from '../dom.js';

/** Reports and reconciliations per page of the lists. */
const LIST_PAGE = 50;
/** Lines per page. */
const LINES_PAGE = 50;
const STATUSES = ['matched', 'provider_over', 'provider_under', 'missing_in_ledger', 'org_mismatch', 'missing_in_provider', 'not_runtime'];

function refusal(error) {
  return notice(error.code || 'error', error.message || String(error));
}

/** A list that grows by pages: rows into `tbody`, a "more" button while `next_after` is set. */
async function pagedList({ url, key, tbody, more, row, after: startAfter = null }) {
  let after = startAfter;
  const page = async () => {
    const answer = await api(url(after));
    tbody.append(...answer[key].map(row));
    after = answer.next_after ?? null;
    more.hidden = !after;
  };
  await page();
  more.addEventListener('click', async () => {
    more.disabled = true;
    try {
      await page();
      more.disabled = false;
    } catch (error) {
      more.replaceWith(refusal(error));
    }
  });
}

function listTable(id, caption, columns, tbody) {
  return h('div', { class: 'table-scroll' },
    h('table', { id },
      h('caption', {}, caption),
      h('thead', {}, h('tr', {}, columns.map((text) => h('th', { scope: 'col' }, text)))),
      tbody));
}

export async function renderList({ view, query: search }) {
  const reportId = search.get('report_id') || undefined;
  view.append(h('h1', {}, 'Reconciliations'));
  const reports = section('Provider reports');
  const reconciliations = section('Reconciliations');
  if (reportId) {
    reconciliations.append(h('p', {}, 'Of report ', h('code', {}, reportId), '. ', h('a', { href: '/console/reconciliations' }, 'Show all')));
  }
  view.append(reconciliations, reports);
  await Promise.all([
    loadReports(reports).catch((error) => reports.append(refusal(error))),
    loadReconciliations(reconciliations, reportId).catch((error) => reconciliations.append(refusal(error))),
  ]);
}

async function loadReports(element) {
  const tbody = h('tbody');
  const more = h('button', { id: 'reports-more', type: 'button', hidden: true }, 'More reports');
  await pagedList({
    url: (after) => `/v1/provider-reports${query({ after, limit: LIST_PAGE })}`,
    key: 'reports',
    tbody,
    more,
    row: (report) => h(
      'tr',
      { dataset: { reportId: report.report_id } },
      h('th', { scope: 'row' }, h('a', { href: address('/console/reconciliations', { report_id: report.report_id }) }, h('code', {}, report.report_id))),
      h('td', {}, time(report.imported_at)),
      h('td', {}, time(report.window_start), ' – ', time(report.window_end)),
      cell('lines', report.lines),
      h('td', {}, shortHex(report.sha256)),
    ),
  });
  element.append(listTable('reports', 'Imported provider reports, newest first', ['Report', 'Imported', 'Window', 'Lines', 'SHA-256'], tbody), more);
}

async function loadReconciliations(element, reportId) {
  const tbody = h('tbody');
  const more = h('button', { id: 'reconciliations-more', type: 'button', hidden: true }, 'More reconciliations');
  await pagedList({
    url: (after) => `/v1/reconciliations${query({ report_id: reportId, after, limit: LIST_PAGE })}`,
    key: 'reconciliations',
    tbody,
    more,
    row: (item) => h(
      'tr',
      { dataset: { reconciliationId: item.reconciliation_id } },
      h('th', { scope: 'row' }, h('a', { href: `/console/reconciliations/${encodeURIComponent(item.reconciliation_id)}` }, h('code', {}, item.reconciliation_id))),
      h('td', {}, time(item.created_at)),
      h('td', {}, h('code', {}, item.report_id)),
      cell('position', item.position),
      h('td', {}, `${item.tolerance_ms} ms, ${item.tolerance_ratio}`),
      h('td', {}, countsText(item.counts)),
    ),
  });
  element.append(
    listTable('reconciliations', 'Reconciliations, newest first', ['Reconciliation', 'Made', 'Report', 'Position', 'Tolerance', 'Lines by status'], tbody),
    more,
  );
}

function countsText(counts = {}) {
  const parts = Object.entries(counts).filter(([, count]) => count > 0).map(([status, count]) => `${status} ${count}`);
  return parts.length ? parts.join(', ') : 'no lines';
}

/** The lines' view as the address gives it. */
function linesView(search) {
  const offset = Math.max(0, Number.parseInt(search.get('offset') || '0', 10) || 0);
  return {
    status: search.get('status') || '',
    org_id: search.get('org_id') || '',
    container_id: search.get('container_id') || '',
    sort: search.get('sort') || 'report_line',
    offset,
  };
}

export async function renderOne({ view, params, query: search, navigate }) {
  const [id] = params;
  const base = `/v1/reconciliations/${encodeURIComponent(id)}`;
  const here = `/console/reconciliations/${encodeURIComponent(id)}`;
  const wanted = linesView(search);
  view.append(h('h1', {}, 'Reconciliation ', h('code', {}, id)), h('p', {}, h('a', { href: '/console/reconciliations' }, '← all reconciliations')));
  const summary = section('Summary');
  const lines = section('Lines');
  view.append(summary, lines);
  // A new view of the lines: the address changes (so it can be pasted) and the page reloads.
  const go = (change) => {
    const next = { ...wanted, offset: 0, ...change };
    if (next.sort === 'report_line') next.sort = '';
    if (!next.offset) next.offset = '';
    navigate(address(here, next));
  };
  await Promise.all([
    loadSummary(summary, base).catch((error) => summary.append(refusal(error))),
    loadLines(lines, base, wanted, go).catch((error) => lines.append(refusal(error))),
  ]);
}

async function loadSummary(element, base) {
  const summary = await api(base);
  if (summary.status !== 'done') {
    // Still running, or failed: the job, and why it failed; its lines come when it is done.
    const error = summary.error ? `${summary.error.code}: ${summary.error.message}` : null;
    element.append(figures(
      term('Status', 'status', summary.status),
      term('Report', 'report_id', summary.report_id, h('a', { href: address('/console/reconciliations', { report_id: summary.report_id }) }, summary.report_id)),
      term('Started', 'started_at', summary.started_at, time(summary.started_at)),
      ...(error ? [term('Error', 'error', error)] : []),
    ));
    return;
  }
  const counts = summary.counts || {};
  const countRows = Object.entries(counts).map(([status, count]) =>
    h('tr', { dataset: { status } }, h('th', { scope: 'row' }, status), cell('count', count)));
  const currencies = summary.totals?.currencies || {};
  const moneyRows = Object.entries(currencies).map(([currency, figures_]) => {
    const total = figures_.total || {};
    return h(
      'tr',
      { dataset: { currency } },
      h('th', { scope: 'row' }, currency),
      cell('lines', total.lines),
      cell('provider_cost', total.provider_cost, total.provider_cost ?? '—'),
      cell('expected_cost', total.expected_cost, total.expected_cost ?? '—'),
      cell('cost_delta', total.cost_delta, total.cost_delta ?? '—'),
    );
  });
  element.append(
    figures(
      term('Report', 'report_id', summary.report_id, h('a', { href: address('/console/reconciliations', { report_id: summary.report_id }) }, summary.report_id)),
      term('Made', 'created_at', summary.created_at, time(summary.created_at)),
      term('Tolerance', 'tolerance_ms', summary.tolerance_ms),
      term('Tolerance ratio', 'tolerance_ratio', summary.tolerance_ratio),
      term('Lines', 'lines', summary.lines),
      term('Position', 'position', summary.position),
    ),
    h('div', { class: 'two' },
      table('status-counts', 'Lines by status', ['Status', 'Lines'], countRows),
      table('totals', `Money per currency (${summary.totals?.rounding ?? 'rounded once per total'})`, ['Currency', 'Lines', 'Provider cost', 'Expected cost', 'Cost delta'], moneyRows)),
  );
}

/** The filter form, sort buttons and one page of lines. */
async function loadLines(element, base, wanted, go) {
  element.append(filterForm(wanted, go));
  const answer = await api(`${base}/lines${query({
    status: wanted.status,
    org_id: wanted.org_id,
    container_id: wanted.container_id,
    sort: wanted.sort,
    offset: wanted.offset,
    limit: LINES_PAGE,
  })}`);
  const total = answer.total ?? 0;
  const first = answer.lines.length ? answer.offset + 1 : 0;
  const last = answer.offset + answer.lines.length;
  const prev = h('button', { id: 'lines-prev', type: 'button', disabled: answer.offset <= 0 }, '← Previous');
  const next = h('button', { id: 'lines-next', type: 'button', disabled: last >= total }, 'Next →');
  prev.addEventListener('click', () => go({ offset: Math.max(0, answer.offset - LINES_PAGE), sort: wanted.sort }));
  next.addEventListener('click', () => go({ offset: last, sort: wanted.sort }));
  element.append(
    h('p', { class: 'position' },
      'Lines ', String(first), '–', String(last), ' of ', figure('lines_total', total), ' · position ', figure('position', answer.position)),
    h('div', { class: 'table-scroll' },
      h('table', { id: 'lines' },
        h('caption', {}, 'Report lines against the ledger'),
        h('thead', {}, linesHeader(wanted.sort, go)),
        h('tbody', {}, answer.lines.map(lineRow)))),
    h('nav', { class: 'pager', 'aria-label': 'Pages of lines' }, prev, next),
  );
}

function filterForm(wanted, go) {
  const status = h('select', { id: 'filter-status', name: 'status' },
    h('option', { value: '' }, 'any status'),
    STATUSES.map((name) => h('option', { value: name, selected: name === wanted.status }, name)));
  const org = h('input', { id: 'filter-org', name: 'org_id', value: wanted.org_id, autocomplete: 'off' });
  const container = h('input', { id: 'filter-container', name: 'container_id', value: wanted.container_id, autocomplete: 'off' });
  const apply = () => go({ status: status.value, org_id: org.value.trim(), container_id: container.value.trim(), sort: wanted.sort });
  const form = h('form', { id: 'lines-filter', class: 'inline' },
    h('label', { for: 'filter-status' }, 'Status'), status,
    h('label', { for: 'filter-org' }, 'Org (ledger or provider tag)'), org,
    h('label', { for: 'filter-container' }, 'Container'), container,
    h('button', { type: 'submit' }, 'Filter'));
  status.addEventListener('change', apply);
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    apply();
  });
  return form;
}

/** The next sort a header's button asks for: a second click on a column turns it around. */
function nextSort(current, column) {
  if (column === 'abs_cost_delta' || column === 'report_line') return column;
  return current === column ? `-${column}` : column;
}

function sortButton(column, text, current, go) {
  const active = current === column || current === `-${column}`;
  const direction = current === `-${column}` ? ' ↓' : active ? ' ↑' : '';
  const button = h('button', { type: 'button', class: 'sort', dataset: { sort: column }, 'aria-pressed': String(active) }, text, direction);
  button.addEventListener('click', () => go({ sort: nextSort(current, column), offset: 0 }));
  return button;
}

function linesHeader(sort, go) {
  const ariaSort = (column) => {
    if (sort === column) return 'ascending';
    if (sort === `-${column}`) return 'descending';
    return undefined;
  };
  const th = (text, column) => h('th', { scope: 'col', 'aria-sort': column ? ariaSort(column) : undefined }, text);
  return h('tr', {},
    th(sortButton('report_line', 'Line', sort, go), 'report_line'),
    th('Status'),
    th('Org'),
    th('Container'),
    th('Charge period'),
    th('Provider'),
    th('Ledger'),
    th(sortButton('delta_ms', 'Δ runtime', sort, go), 'delta_ms'),
    th('Provider cost'),
    th('Expected cost'),
    h('th', { scope: 'col', 'aria-sort': ariaSort('cost_delta') ?? (sort === 'abs_cost_delta' ? 'descending' : undefined) },
      sortButton('cost_delta', 'Δ cost', sort, go), ' ', sortButton('abs_cost_delta', '|Δ| largest', sort, go)),
    th('Currency'),
  );
}

function lineRow(line) {
  // An org_mismatch line was compared with no org's container: it is listed under the
  // provider's tag, whose org has no container of the id, so it has no timeline to show.
  const comparedWithNone = line.status === 'org_mismatch' && line.org_id === line.provider_org_id;
  const timelineHref = line.container_id && !comparedWithNone
    ? address(`/console/containers/${encodeURIComponent(line.container_id)}`, {
      org_id: line.org_id,
      from: line.charge_period_start,
      to: line.charge_period_end,
      provider_ms: line.provider_runtime_ms,
      ledger_ms: line.ledger_runtime_ms,
    })
    : null;
  const orgText = line.provider_org_id && line.provider_org_id !== line.org_id
    ? `${line.org_id ?? '—'} (tag ${line.provider_org_id})`
    : line.org_id ?? '—';
  return h(
    'tr',
    { dataset: { reportLine: line.report_line ?? '', status: line.status, containerId: line.container_id ?? '' } },
    cell('report_line', line.report_line, line.report_line ?? '—'),
    h('td', { class: `status ${line.status}` }, line.status),
    h('td', {}, orgText),
    h('td', {}, line.container_id
      ? h('a', { class: 'timeline-link', href: timelineHref, title: 'Timeline for this charge period' }, line.container_id)
      : '—'),
    h('td', {}, time(line.charge_period_start), ' – ', time(line.charge_period_end)),
    cell('provider_runtime_ms', line.provider_runtime_ms),
    cell('ledger_runtime_ms', line.ledger_runtime_ms),
    cell('delta_ms', line.delta_ms),
    cell('provider_cost', line.provider_cost, line.provider_cost ?? '—'),
    cell('expected_cost', line.expected_cost, line.expected_cost ?? '—'),
    cell('cost_delta', line.cost_delta, line.cost_delta ?? '—'),
    h('td', {}, line.currency),
  );
}
