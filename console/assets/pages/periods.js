// Billing periods: their states; one period's closed snapshot (re-hashed by the API) and
// its usage export, which can be saved as CSV (fetched with the token, saved from a Blob).

import { api, query } from '../api.js';
import {
  cell, figure, figures, h, notice, section, shortHex, table, term, time,
} from '../dom.js';

/** Periods listed: two years of months. */
const PERIODS_SHOWN = 24;

function refusal(error) {
  return notice(error.code || 'error', error.message || String(error));
}

export async function renderList({ view }) {
  view.append(h('h1', {}, 'Periods'));
  const list = section('Billing periods');
  view.append(list);
  try {
    const answer = await api(`/v1/periods${query({ limit: PERIODS_SHOWN })}`);
    const rows = answer.periods.map((period) => h(
      'tr',
      { dataset: { period: period.period, state: period.state } },
      h('th', { scope: 'row' }, h('a', { href: `/console/periods/${period.period}` }, period.period)),
      cell('state', period.state),
      h('td', {}, time(period.closed_at)),
      cell('orgs', period.orgs),
      h('td', {}, shortHex(period.sha256)),
    ));
    list.append(table('periods', 'Periods, newest first', ['Period', 'State', 'Closed', 'Orgs', 'Snapshot SHA-256'], rows));
  } catch (error) {
    list.append(refusal(error));
  }
}

export async function renderOne({ view, params }) {
  const [period] = params;
  view.append(h('h1', {}, 'Period ', period), h('p', {}, h('a', { href: '/console/periods' }, '← all periods')));
  const close = section('Close');
  const usage = section('Usage export');
  view.append(close, usage);
  await Promise.all([
    loadClose(close, period).catch((error) => close.append(refusal(error))),
    loadExport(usage, period).catch((error) => usage.append(refusal(error))),
  ]);
}

async function loadClose(element, period) {
  let closed;
  try {
    closed = await api(`/v1/periods/${encodeURIComponent(period)}`);
  } catch (error) {
    // Not a refusal: the period is simply still open (or its close is under way).
    if (error.code !== 'period_not_closed') throw error;
    element.append(h('p', { class: 'open-period', dataset: { code: error.code } }, `${period} is not closed yet; the export below is live.`));
    return;
  }
  element.append(
    figures(
      term('Verified', 'verified', closed.verified, closed.verified ? 'yes: the snapshot still hashes to its SHA-256' : 'NO: the snapshot does not match its hash'),
      term('SHA-256', 'sha256', closed.sha256, h('code', { class: 'hash' }, closed.sha256)),
      term('Closed', 'closed_at', closed.closed_at, time(closed.closed_at)),
      term('Orgs', 'orgs', closed.orgs),
      term('Position', 'position', closed.position),
    ),
  );
}

async function loadExport(element, period) {
  const path = `/v1/exports/usage.csv${query({ period })}`;
  const answer = await api(`/v1/exports/usage.csv${query({ period, format: 'json' })}`);
  const rows = answer.rows.map((row) => h(
    'tr',
    { dataset: { orgId: row.org_id } },
    h('th', { scope: 'row' }, h('a', { href: `/console/orgs/${encodeURIComponent(row.org_id)}?period=${period}` }, row.org_id)),
    cell('plan', row.plan),
    cell('runtime_ms', row.runtime_ms),
    cell('included_ms', row.included_ms),
    cell('overage_ms', row.overage_ms),
    cell('overage_amount', row.overage_amount),
    cell('currency', row.currency),
    cell('commands', row.commands),
    cell('ports_published', row.ports_published),
  ));
  const adjustments = (answer.adjustments || []).map((row) => h(
    'tr',
    { dataset: { orgId: row.org_id, period: row.period } },
    h('th', { scope: 'row' }, row.org_id),
    h('td', {}, row.period),
    cell('runtime_ms', row.runtime_ms),
    cell('overage_amount', row.overage_amount),
    cell('currency', row.currency),
    h('td', {}, String((row.caused_by || []).length)),
  ));
  const columns = ['Org', 'Plan', 'Runtime', 'Included', 'Overage', 'Amount', 'Currency', 'Commands', 'Ports'];
  element.append(h(
    'div',
    {},
    h('p', { class: 'position' }, 'Position ', figure('position', answer.position)),
    h('p', {}, downloadLink(path, `usage-${period}.csv`)),
    table('export', `Usage per org in ${period}`, columns, rows),
    rows.length === 0 ? h('p', {}, 'No org has usage in this period.') : null,
    adjustments.length
      ? table('adjustments', 'Adjustments to closed periods, due in this one', ['Org', 'Closed period', 'Runtime', 'Amount', 'Currency', 'Events'], adjustments)
      : null,
  ));
}

/**
 * The CSV as a download: fetched with the token on the first click (a plain link could not
 * send it), then offered from a Blob URL, which the link keeps.
 */
function downloadLink(path, filename) {
  const anchor = h('a', { id: 'export-download', href: path, download: filename }, 'Download CSV');
  anchor.addEventListener('click', async (event) => {
    if (anchor.href.startsWith('blob:')) return;
    event.preventDefault();
    try {
      const response = await api(path, { raw: true });
      const blob = await response.blob();
      anchor.href = URL.createObjectURL(blob);
      anchor.dataset.position = response.headers.get('tally-position') ?? '';
      anchor.click();
    } catch (error) {
      anchor.after(refusal(error));
    }
  });
  return anchor;
}
