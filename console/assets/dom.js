// Building the page: elements, figures, times, tables and notices. Text always goes in
// through textContent, never as markup, so nothing the API returns can become markup.

/** An element: h('td', {class: 'x', dataset: {figure: 'y'}}, 'text', child, ...). */
export function h(tag, attributes = {}, ...children) {
  const svg = SVG_TAGS.has(tag);
  const element = svg
    ? document.createElementNS('http://www.w3.org/2000/svg', tag)
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === 'dataset') {
      for (const [key, data] of Object.entries(value)) {
        if (data !== undefined) element.dataset[key] = String(data);
      }
    } else if (name.startsWith('on')) {
      element.addEventListener(name.slice(2), value);
    } else {
      element.setAttribute(name, value === true ? '' : String(value));
    }
  }
  append(element, children);
  return element;
}

const SVG_TAGS = new Set(['svg', 'g', 'rect', 'line', 'circle', 'path', 'text', 'title', 'polygon']);

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
}

/** The raw API value as the `data-value` attribute holds it. */
export function raw(value) {
  return value === null || value === undefined ? 'null' : String(value);
}

/** A figure: its API name and raw value in data attributes, formatted for a reader. */
export function figure(name, value, text = formatted(name, value), tag = 'span') {
  return h(tag, { class: 'figure', dataset: { figure: name, value: raw(value) } }, text);
}

/** A labelled figure for a figure list (`<dl class="figures">`). */
export function term(label, name, value, text) {
  return h('div', {}, h('dt', {}, label), h('dd', {}, figure(name, value, text)));
}

export function figures(...terms) {
  return h('dl', { class: 'figures' }, ...terms);
}

const INTEGER = new Intl.NumberFormat('en-US');

/** A figure in words by its name: durations, times, counts, money and flags. */
export function formatted(name, value) {
  if (value === null || value === undefined) return '—';
  if (typeof value === 'boolean') return value ? 'yes' : 'no';
  if (name.endsWith('_ms') && typeof value === 'number') return duration(value);
  if (typeof value === 'number') return INTEGER.format(value);
  return String(value);
}

/** Milliseconds as "3 h 25 min 10 s" (or "250 ms" under a second). */
export function duration(ms) {
  if (!Number.isFinite(ms)) return String(ms);
  if (Math.abs(ms) < 1000) return `${ms} ms`;
  const sign = ms < 0 ? '−' : '';
  let seconds = Math.floor(Math.abs(ms) / 1000);
  const days = Math.floor(seconds / 86400);
  seconds -= days * 86400;
  const hours = Math.floor(seconds / 3600);
  seconds -= hours * 3600;
  const minutes = Math.floor(seconds / 60);
  seconds -= minutes * 60;
  const parts = [];
  if (days) parts.push(`${days} d`);
  if (hours) parts.push(`${hours} h`);
  if (minutes) parts.push(`${minutes} min`);
  if (seconds || parts.length === 0) parts.push(`${seconds} s`);
  return sign + parts.join(' ');
}

/** "2026-12-01 10:00:00 UTC" from an RFC 3339 time. */
export function utcText(iso) {
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return String(iso);
  return `${date.toISOString().slice(0, 19).replace('T', ' ')} UTC`;
}

/** A time: UTC as text, the local time on hover. */
export function time(iso) {
  if (iso === null || iso === undefined) return h('span', { class: 'none' }, '—');
  const date = new Date(iso);
  const local = Number.isNaN(date.getTime())
    ? ''
    : `${date.toLocaleString()} (${Intl.DateTimeFormat().resolvedOptions().timeZone})`;
  return h('time', { datetime: iso, title: local }, utcText(iso));
}

/** A figure that is a time. */
export function timeFigure(name, iso) {
  return h('span', { class: 'figure', dataset: { figure: name, value: raw(iso) } }, time(iso));
}

/** A refusal or error, with the API's code: `<p role="alert" class="notice" data-code>`. */
export function notice(code, text) {
  return h('p', { role: 'alert', class: 'notice', dataset: { code } }, text);
}

/** A section with a heading. */
export function section(title, ...children) {
  const id = `h-${title.toLowerCase().replace(/[^a-z0-9]+/g, '-')}`;
  return h('section', { 'aria-labelledby': id }, h('h2', { id }, title), ...children);
}

/**
 * A table: `columns` are header texts, `rows` are `<tr>` elements. Wrapped so that a wide
 * table scrolls on its own on a phone, not the page.
 */
export function table(id, caption, columns, rows) {
  return h(
    'div',
    { class: 'table-scroll' },
    h(
      'table',
      { id },
      h('caption', {}, caption),
      h('thead', {}, h('tr', {}, columns.map((column) => h('th', { scope: 'col' }, column)))),
      h('tbody', {}, rows),
    ),
  );
}

/** A cell holding one figure. */
export function cell(name, value, text) {
  return h('td', { dataset: { figure: name, value: raw(value) } }, text ?? formatted(name, value));
}

/** A link inside the console (the router takes the click). */
export function link(href, text, attributes = {}) {
  return h('a', { href, ...attributes }, text);
}

/** An address of the console with a query, leaving out empty values. */
export function address(path, query = {}) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(query)) {
    if (value !== undefined && value !== null && value !== '') search.set(name, String(value));
  }
  const text = search.toString();
  return text ? `${path}?${text}` : path;
}

/** A short form of a long hex value, the whole on hover. */
export function shortHex(hex) {
  if (!hex) return h('span', { class: 'none' }, '—');
  return h('code', { title: hex }, hex.length > 16 ? `${hex.slice(0, 12)}…` : hex);
}
