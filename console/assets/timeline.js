// A container's life as a small SVG of our own (decision 0028): running intervals as bars,
// lifecycle events as rules, commands as ticks as long as they ran, published ports as dots
// and anomalies as triangles, over a UTC time axis. Each mark carries its figures in data
// attributes and a <title> for hover; the page also lists them in tables.

import { h, utcText } from './dom.js';

const HEIGHT = 170;
const MARGIN_LEFT = 84;
const MARGIN_RIGHT = 16;
const ROWS = {
  intervals: { y: 28, height: 30, label: 'running' },
  commands: { y: 70, height: 16, label: 'commands' },
  ports: { y: 100, height: 12, label: 'ports' },
  anomalies: { y: 120, height: 14, label: 'anomalies' },
};
const AXIS_Y = 146;
const LIFECYCLE = new Set(['container.created', 'container.stopped', 'container.resumed']);

/** The instants the timeline spans: the charge period asked for, else the whole life. */
export function span({ intervals, anomalies, events, from, to, now }) {
  if (from !== null && to !== null && to > from) return [from, to];
  const instants = [];
  for (const interval of intervals) {
    instants.push(Date.parse(interval.start), interval.end ? Date.parse(interval.end) : now);
  }
  for (const anomaly of anomalies) instants.push(Date.parse(anomaly.occurred_at));
  for (const event of events) instants.push(Date.parse(event.occurred_at));
  const known = instants.filter(Number.isFinite);
  if (known.length === 0) return [now - 3_600_000, now];
  let start = Math.min(...known);
  let end = Math.max(...known);
  if (end - start < 60_000) {
    start -= 30_000;
    end += 30_000;
  }
  const pad = (end - start) * 0.02;
  return [start - pad, end + pad];
}

/** The SVG. `width` is the box it is drawn for, in CSS pixels. */
export function timeline({ containerId, intervals, anomalies, events, from = null, to = null, now = Date.now(), width = 960 }) {
  const [start, end] = span({ intervals, anomalies, events, from, to, now });
  const plotWidth = Math.max(120, width - MARGIN_LEFT - MARGIN_RIGHT);
  const x = (instant) => ((instant - start) / (end - start)) * plotWidth;
  const plot = h('svg', { class: 'plot', x: MARGIN_LEFT, y: 0, width: plotWidth, height: HEIGHT });
  const commands = events.filter((event) => event.type === 'container.command_ran');
  const ports = events.filter((event) => event.type === 'container.port_published');
  for (const event of events.filter((event) => LIFECYCLE.has(event.type))) {
    const at = x(Date.parse(event.occurred_at));
    plot.append(
      h('line', { class: 'lifecycle', x1: at, x2: at, y1: 16, y2: AXIS_Y, dataset: { type: event.type, position: event.position } },
        h('title', {}, `${event.type} at ${utcText(event.occurred_at)}`)),
    );
  }
  for (const interval of intervals) plot.append(intervalMark(interval, x, now));
  for (const event of commands) plot.append(commandMark(event, x));
  for (const event of ports) {
    const at = x(Date.parse(event.occurred_at));
    const row = ROWS.ports;
    plot.append(
      h('circle', { class: 'port', cx: at, cy: row.y + row.height / 2, r: 5, dataset: { port: event.data?.port } },
        h('title', {}, `port ${event.data?.port} published at ${utcText(event.occurred_at)}`)),
    );
  }
  for (const anomaly of anomalies) {
    const at = x(Date.parse(anomaly.occurred_at));
    const row = ROWS.anomalies;
    const points = `${at},${row.y} ${at - 6},${row.y + row.height} ${at + 6},${row.y + row.height}`;
    plot.append(
      h('polygon', { class: 'anomaly', points, dataset: { kind: anomaly.kind, eventId: anomaly.event_id } },
        h('title', {}, `${anomaly.kind} at ${utcText(anomaly.occurred_at)}`)),
    );
  }
  const label = `Timeline of container ${containerId} from ${utcText(new Date(start).toISOString())} to ${utcText(new Date(end).toISOString())}: `
    + `${intervals.length} running intervals, ${commands.length} commands, ${ports.length} ports published, ${anomalies.length} anomalies`;
  return h(
    'svg',
    { id: 'timeline', role: 'img', 'aria-label': label, viewBox: `0 0 ${width} ${HEIGHT}`, width: '100%', height: HEIGHT, preserveAspectRatio: 'xMinYMin meet' },
    h('title', {}, label),
    Object.values(ROWS).map((row) =>
      h('text', { class: 'row-label', x: MARGIN_LEFT - 8, y: row.y + row.height / 2 + 4, 'text-anchor': 'end' }, row.label)),
    h('line', { class: 'axis', x1: MARGIN_LEFT, x2: MARGIN_LEFT + plotWidth, y1: AXIS_Y, y2: AXIS_Y }),
    axisTicks(start, end, x).map((tick) => {
      tick.setAttribute('transform', `translate(${MARGIN_LEFT}, 0)`);
      return tick;
    }),
    plot,
  );
}

function intervalMark(interval, x, now) {
  const startAt = Date.parse(interval.start);
  const endAt = interval.end ? Date.parse(interval.end) : now;
  const left = x(startAt);
  const row = ROWS.intervals;
  const words = `running from ${utcText(interval.start)} to ${interval.end ? utcText(interval.end) : 'now (still running)'}`;
  return h(
    'rect',
    {
      class: interval.end ? 'interval' : 'interval open',
      x: left,
      y: row.y,
      width: Math.max(1, x(endAt) - left),
      height: row.height,
      dataset: { start: interval.start, end: interval.end ?? '' },
    },
    h('title', {}, words),
  );
}

function commandMark(event, x) {
  const at = Date.parse(event.occurred_at);
  const durationMs = Number(event.data?.duration_ms ?? 0);
  const left = x(at);
  const row = ROWS.commands;
  const exitCode = event.data?.exit_code;
  return h(
    'rect',
    {
      class: exitCode === 0 ? 'command' : 'command failed',
      x: left,
      y: row.y,
      width: Math.max(2, x(at + durationMs) - left),
      height: row.height,
      dataset: { exitCode, durationMs, position: event.position },
    },
    h('title', {}, `command ${event.data?.command_id ?? ''} at ${utcText(event.occurred_at)}: exit ${exitCode}, ${durationMs} ms`),
  );
}

/** Ticks on a UTC axis at a round step that gives about six labels. */
function axisTicks(start, end, x) {
  const steps = [1, 5, 15, 30, 60, 300, 900, 1800, 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400].map((s) => s * 1000);
  const step = steps.find((candidate) => (end - start) / candidate <= 6) ?? 30 * 86400 * 1000;
  const ticks = [];
  for (let at = Math.ceil(start / step) * step; at <= end; at += step) {
    const iso = new Date(at).toISOString();
    const text = step >= 86400 * 1000 ? iso.slice(5, 10) : step >= 60_000 ? iso.slice(11, 16) : iso.slice(11, 19);
    ticks.push(
      h('g', { class: 'tick' },
        h('line', { x1: x(at), x2: x(at), y1: AXIS_Y, y2: AXIS_Y + 5 }),
        h('text', { x: x(at), y: AXIS_Y + 18, 'text-anchor': 'middle' }, text)),
    );
  }
  return ticks;
}
