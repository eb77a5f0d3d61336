// An org's period: usage against the allowance, per day (chart and table), running
// containers, what admission would say now, and the plan's history. Each section asks the
// API on its own, so a token without one section's scope still sees the others.

import { api, query } from '../api.js';
import { daysChart } from '../chart.js';
import {
  address, cell, duration, figure, figures, formatted, h, notice, section, table, term, time,
} from '../dom.js';

/** Running containers per page. */
const RUNNING_PAGE = 50;
const ACTIONS = ['create', 'resume', 'run', 'publish_port'];

/** `YYYY-MM` of now, in UTC. */
export function currentPeriod() {
  return new Date().toISOString().slice(0, 7);
}

/** The period `months` before or after `period`. */
function shiftPeriod(period, months) {
  const [year, month] = period.split('-').map(Number);
  const date = new Date(Date.UTC(year, month - 1 + months, 1));
  return date.toISOString().slice(0, 7);
}

/** A section's body replaced: its heading stays. */
function fill(element, ...children) {
  element.replaceChildren(element.firstElementChild, ...children.filter(Boolean));
}

/** A refusal in place of a section's figures. */
function refused(element, error) {
  fill(element, notice(error.code || 'error', error.message || String(error)));
}

export async function render({ view, params, query: search, principal, navigate }) {
  const [orgId] = params;
  const period = search.get('period') || currentPeriod();
  const orgPath = `/console/orgs/${encodeURIComponent(orgId)}`;
  view.append(h('h1', {}, 'Org ', h('code', {}, orgId)), periodPicker(orgPath, period, navigate));
  if (principal.org_id && principal.org_id !== orgId) {
    view.append(notice('org_not_allowed', `This token is bound to org ${principal.org_id}; it may not read org ${orgId}.`));
    return;
  }
  const usage = section('Usage');
  const running = section('Running containers');
  const admission = section('Admission now');
  const account = section('Plan and account');
  for (const part of [usage, running, admission, account]) part.append(h('p', { class: 'loading' }, 'Loading…'));
  view.append(h('div', { class: 'org-grid' }, usage, account, running, admission));
  const base = `/v1/orgs/${encodeURIComponent(orgId)}`;
  await Promise.all([
    loadUsage(usage, base, period).catch((error) => refused(usage, error)),
    loadAccount(account, base, period).catch((error) => refused(account, error)),
    loadRunning(running, base, orgId)
      .catch((error) => {
        refused(running, error);
        return null;
      })
      .then((first) => loadAdmission(admission, orgId, first))
      .catch((error) => refused(admission, error)),
  ]);
}

function periodPicker(orgPath, period, navigate) {
  const input = h('input', { id: 'period', name: 'period', type: 'month', value: period, required: true });
  const form = h(
    'form',
    { id: 'period-form', class: 'inline' },
    h('a', { href: address(orgPath, { period: shiftPeriod(period, -1) }), rel: 'prev' }, '← ', shiftPeriod(period, -1)),
    h('label', { for: 'period' }, 'Period (UTC month)'),
    input,
    h('button', { type: 'submit' }, 'Show'),
    h('a', { href: address(orgPath, { period: shiftPeriod(period, 1) }), rel: 'next' }, shiftPeriod(period, 1), ' →'),
  );
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    navigate(address(orgPath, { period: input.value }));
  });
  return form;
}

async function loadUsage(element, base, period) {
  const usage = await api(`${base}/usage${query({ period, window: 'day' })}`);
  const days = Array.isArray(usage.days) ? usage.days : [];
  const amount = usage.overage_amount === undefined ? undefined : `${usage.overage_amount} ${usage.currency ?? ''}`.trim();
  fill(
    element,
    figures(
      term('Period', 'period', usage.period),
      term('As of', 'as_of', usage.as_of, time(usage.as_of)),
      term('Runtime', 'runtime_ms', usage.runtime_ms),
      term('Included', 'included_ms', usage.included_ms),
      term('Overage', 'overage_ms', usage.overage_ms),
      term('Overage amount', 'overage_amount', usage.overage_amount, amount),
      term('Currency', 'currency', usage.currency),
      term('Running containers', 'running_containers', usage.running_containers),
      term('Commands', 'commands', usage.commands),
      term('Command time', 'command_ms', usage.command_ms),
      term('Ports published', 'ports_published', usage.ports_published),
      term('Position', 'position', usage.position),
    ),
    allowance(usage),
    daysFigure(days, usage.period),
  );
  // The chart measures its box, so it is drawn once the section is in the page.
  const chartBox = element.querySelector('#days-chart .chart');
  if (chartBox && days.length > 0) daysChart(chartBox, days);
}

/** The allowance gauge: runtime used against the plan's included runtime. */
function allowance(usage) {
  const included = usage.included_ms ?? 0;
  const used = usage.runtime_ms ?? 0;
  const max = Math.max(included, 1);
  const share = included > 0 ? `${Math.round((used / included) * 100)} %` : 'no allowance';
  const words = `${duration(used)} used of ${duration(included)} included (${share})`;
  return h(
    'div',
    { class: 'allowance' },
    h('label', { for: 'allowance' }, 'Allowance'),
    h('meter', {
      id: 'allowance',
      min: 0,
      max,
      value: Math.min(used, max),
      high: Math.floor(max * 0.8),
      optimum: 0,
      'aria-label': words,
    }),
    h('span', { class: 'meter-text' }, words),
  );
}

function daysFigure(days, period) {
  const rows = days.map((day) =>
    h(
      'tr',
      { dataset: { day: day.date } },
      h('th', { scope: 'row' }, day.date),
      cell('runtime_ms', day.runtime_ms),
      cell('commands', day.commands),
      cell('command_ms', day.command_ms),
    ),
  );
  return h(
    'div',
    { class: 'days' },
    h(
      'figure',
      { id: 'days-chart' },
      h('div', { class: 'chart', role: 'img', 'aria-label': `Runtime hours and commands per UTC day of ${period}; the table below has the same figures` }),
      h('figcaption', {}, days.length ? `Per UTC day of ${period}: runtime (bars, hours) and commands (line).` : 'No days of this period have begun yet.'),
    ),
    table('days-table', `Per UTC day of ${period}`, ['Day (UTC)', 'Runtime', 'Commands', 'Command time'], rows),
  );
}

/** One page of running containers into `tbody`; the "more" button fetches the next. */
async function loadRunning(element, base, orgId) {
  const tbody = h('tbody');
  const more = h('button', { id: 'running-more', type: 'button', hidden: true }, 'More containers');
  const positionSlot = h('p', { class: 'position' });
  let first = null;
  let after = null;
  const page = async () => {
    const answer = await api(`${base}/containers${query({ state: 'running', after, limit: RUNNING_PAGE })}`);
    positionSlot.replaceChildren('Position ', figure('position', answer.position));
    for (const container of answer.containers) {
      first ??= container.container_id;
      tbody.append(runningRow(container, orgId));
    }
    after = answer.next_after;
    more.hidden = !after;
  };
  await page();
  more.addEventListener('click', async () => {
    more.disabled = true;
    try {
      await page();
    } catch (error) {
      more.replaceWith(notice(error.code || 'error', error.message));
    }
    more.disabled = false;
  });
  const tableElement = h(
    'table',
    { id: 'running-containers' },
    h('caption', {}, 'Containers running now'),
    h('thead', {}, h('tr', {}, ['Container', 'Running since', 'Last event'].map((text) => h('th', { scope: 'col' }, text)))),
    tbody,
  );
  const empty = tbody.children.length === 0 ? h('p', {}, 'No container is running.') : null;
  fill(element, positionSlot, h('div', { class: 'table-scroll' }, tableElement), empty, more);
  return first;
}

function runningRow(container, orgId) {
  const href = address(`/console/containers/${encodeURIComponent(container.container_id)}`, { org_id: orgId });
  return h(
    'tr',
    { dataset: { containerId: container.container_id } },
    h('th', { scope: 'row' }, h('a', { href }, container.container_id)),
    h('td', {}, time(container.running_since)),
    h('td', {}, time(container.last_event_at)),
  );
}

/** What admission says now for each action; run and publish_port against `container`. */
async function loadAdmission(element, orgId, container) {
  const checks = await Promise.all(
    ACTIONS.map((action) => {
      const needsContainer = action === 'run' || action === 'publish_port';
      if (needsContainer && !container) return null;
      const body = { org_id: orgId, action, ...(needsContainer ? { container_id: container } : {}) };
      return api('/v1/admission/check', { method: 'POST', body });
    }),
  );
  const rows = ACTIONS.map((action, index) => admissionRow(action, checks[index], container));
  const positions = checks.filter(Boolean).map((check) => check.position).filter((position) => position !== undefined);
  fill(
    element,
    h('p', { class: 'position' }, 'Position ', figure('position', positions.length ? Math.max(...positions) : null)),
    table('admission', 'Would admission allow this now?', ['Action', 'Allowed', 'Reasons', 'Container'], rows),
  );
}

function admissionRow(action, check, container) {
  if (!check) {
    return h(
      'tr',
      { dataset: { action, applicable: 'false' } },
      h('th', { scope: 'row' }, action),
      h('td', { colspan: 3 }, 'not applicable: no container of this org is running'),
    );
  }
  const reasons = check.reasons || [];
  return h(
    'tr',
    { dataset: { action, allowed: String(check.allowed), reasons: reasons.join(',') } },
    h('th', { scope: 'row' }, action),
    h('td', { class: check.allowed ? 'yes' : 'no' }, check.allowed ? 'allowed' : 'refused'),
    h('td', {}, reasons.length ? reasons.join(', ') : '—'),
    h('td', {}, action === 'run' || action === 'publish_port' ? h('code', {}, container) : '—'),
  );
}

/** The org's plan, verification and billing eligibility, and how they changed. */
async function loadAccount(element, base, period) {
  // A past period is shown with the plan in effect at its end; the current one with now.
  const end = Date.parse(`${shiftPeriod(period, 1)}-01T00:00:00Z`);
  const asOf = Number.isFinite(end) && end <= Date.now() ? new Date(end - 1).toISOString() : undefined;
  const org = await api(`${base}${query({ as_of: asOf })}`);
  const plan = org.plan || {};
  const rows = (org.history || []).map((entry) =>
    h(
      'tr',
      { dataset: { position: entry.position, change: entry.change } },
      h('td', {}, time(entry.occurred_at)),
      h('td', {}, entry.change),
      cell('value', entry.value, formatted('value', entry.value)),
      h('td', {}, String(entry.position)),
      h('td', {}, h('code', {}, entry.event_id)),
    ),
  );
  const shown = rows.length;
  const total = org.history_total ?? shown;
  fill(
    element,
    figures(
      term('Plan', 'plan', plan.id, plan.id ? `${plan.id} (version ${plan.version})` : '—'),
      term('Verified', 'verified', org.verified),
      term('Billing eligible', 'billing_eligible', org.billing_eligible),
      term('As of', 'as_of', org.as_of, time(org.as_of)),
      term('Position', 'position', org.position),
    ),
    planTerms(plan),
    table('plan-history', 'Changes, newest first', ['When (UTC)', 'Change', 'Value', 'Position', 'Event'], rows),
    total > shown ? h('p', {}, `${shown} of ${total} changes shown; the audit page has them all.`) : null,
  );
}

function planTerms(plan) {
  if (!plan.id) return null;
  return h(
    'p',
    { class: 'plan-terms' },
    `${plan.sandbox_runtime ? 'Sandboxes allowed' : 'No sandboxes'}; `,
    `${duration(plan.included_runtime_seconds * 1000)} included; overage ${plan.overage}`,
    plan.overage === 'bill' ? ` at ${plan.overage_price_per_hour} ${plan.currency}/h` : '',
    `; at most ${plan.max_running_containers} running, ${plan.max_published_ports} ports. In effect since `,
    time(plan.effective_from),
    '.',
  );
}
