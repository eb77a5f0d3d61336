// The per-day chart of an org's period, drawn by uPlot (vendor/uplot, decision 0028) on a
// canvas: runtime hours as bars, commands as a line on their own axis. Times are UTC. The
// same figures are always in a table beside it, which is what a screen reader reads.

const HOUR_MS = 3_600_000;
const HEIGHT_PX = 240;

/** Draws `days` into `container`; nothing when uPlot did not load or there are no days. */
export function daysChart(container, days) {
  const uPlot = globalThis.uPlot;
  if (!uPlot || days.length === 0) return null;
  const xs = days.map((day) => Date.parse(`${day.date}T00:00:00Z`) / 1000);
  const hours = days.map((day) => day.runtime_ms / HOUR_MS);
  const commands = days.map((day) => day.commands);
  const width = () => Math.max(260, Math.floor(container.getBoundingClientRect().width) || 600);
  const options = {
    width: width(),
    height: HEIGHT_PX,
    tzDate: (seconds) => uPlot.tzDate(new Date(seconds * 1000), 'Etc/UTC'),
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: true }, commands: { auto: true, range: (u, min, max) => [0, Math.max(1, max)] } },
    series: [
      { label: 'day (UTC)', value: '{YYYY}-{MM}-{DD}' },
      {
        label: 'runtime (hours)',
        stroke: '#2563eb',
        fill: 'rgba(37, 99, 235, 0.35)',
        paths: uPlot.paths.bars({ size: [0.7, 48] }),
        points: { show: false },
        value: (u, value) => (value === null ? '—' : value.toFixed(2)),
      },
      {
        label: 'commands',
        scale: 'commands',
        stroke: '#d97706',
        width: 2,
        value: (u, value) => (value === null ? '—' : String(value)),
      },
    ],
    axes: [
      { values: (u, splits) => splits.map((seconds) => new Date(seconds * 1000).toISOString().slice(5, 10)) },
      { label: 'hours', size: 56 },
      { side: 1, scale: 'commands', label: 'commands', grid: { show: false }, size: 56 },
    ],
  };
  const plot = new uPlot(options, [xs, hours, commands], container);
  const observer = new ResizeObserver(() => {
    if (!container.isConnected) {
      observer.disconnect();
      plot.destroy();
      return;
    }
    plot.setSize({ width: width(), height: HEIGHT_PX });
  });
  observer.observe(container);
  return plot;
}
