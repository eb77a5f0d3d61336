// The console's entry: reads the address, asks for a token when there is none, and renders
// the page the address names into <main id="page">. Links inside the console are followed
// without reloading; every page is an address that can be pasted.

import { ApiError, token, whoami } from './api.js';
import { h, notice } from './dom.js';
import * as signin from './pages/signin.js';
import * as home from './pages/home.js';
import * as org from './pages/org.js';
import * as container from './pages/container.js';
import * as reconciliations from './pages/reconciliations.js';
import * as periods from './pages/periods.js';
import * as audit from './pages/audit.js';
import * as operator from './pages/operator.js';

/** Each page: its `data-page` name, the addresses it answers and its renderer. */
const ROUTES = [
  ['home', /^\/console\/?$/, home.render],
  ['org', /^\/console\/orgs\/([^/]+)\/?$/, org.render],
  ['container', /^\/console\/containers\/([^/]+)\/?$/, container.render],
  ['reconciliations', /^\/console\/reconciliations\/?$/, reconciliations.renderList],
  ['reconciliation', /^\/console\/reconciliations\/([^/]+)\/?$/, reconciliations.renderOne],
  ['periods', /^\/console\/periods\/?$/, periods.renderList],
  ['period', /^\/console\/periods\/([^/]+)\/?$/, periods.renderOne],
  ['audit', /^\/console\/audit\/?$/, audit.render],
  ['operator', /^\/console\/operator\/?$/, operator.render],
];

const page = document.getElementById('page');
const signoutButton = document.getElementById('signout');
const who = document.getElementById('who');

/** Who the token is, asked once per sign-in. */
let principal = null;
/** Increases with each render, so that a slow page never writes over a newer one. */
let generation = 0;

function match(pathname) {
  for (const [name, pattern, render] of ROUTES) {
    const found = pattern.exec(pathname);
    if (found) return { name, render, params: found.slice(1).map(decodeURIComponent) };
  }
  return null;
}

/** Go to a console address; the page is rendered again from it. */
export function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, '', url);
  else history.pushState(null, '', url);
  window.scrollTo(0, 0);
  render();
}

function showPrincipal() {
  signoutButton.hidden = !principal;
  document.body.dataset.signedIn = principal ? 'true' : 'false';
  if (!principal) {
    who.textContent = '';
    return;
  }
  const bound = principal.org_id ? ` · org ${principal.org_id}` : '';
  who.textContent = `${principal.token_id}${bound}`;
  who.title = `scopes: ${(principal.scopes || []).join(', ')}`;
}

/**
 * Asks the service who the token is; a token it refuses is dropped (false). A service
 * without `/v1/whoami` still lets the reader in, knowing nothing of the token's scopes.
 */
async function knowPrincipal() {
  if (principal) return true;
  try {
    principal = await whoami();
    return true;
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      token.clear();
      return false;
    }
    if (error instanceof ApiError && error.status === 404) {
      principal = { token_id: 'token', scopes: [], org_id: null };
      return true;
    }
    throw error;
  }
}

/** Renders the page for the current address. `refusal`: why the reader must sign in. */
async function render(refusal = null) {
  generation += 1;
  const mine = generation;
  page.removeAttribute('data-ready');
  const view = h('div', { class: 'view' });
  page.replaceChildren(view);
  const route = match(location.pathname);
  const context = {
    view,
    query: new URLSearchParams(location.search),
    navigate,
    current: () => mine === generation,
  };
  try {
    if (token.get() && !(await knowPrincipal())) {
      refusal = new ApiError(401, 'unauthorized', 'The service did not accept that token.');
    }
    showPrincipal();
    if (!token.get()) {
      page.dataset.page = 'signin';
      document.title = 'tally · sign in';
      await signin.render({ ...context, refusal, signedIn: () => render() });
    } else if (!route) {
      page.dataset.page = 'home';
      document.title = 'tally · not found';
      view.append(
        h('h1', {}, 'Not found'),
        notice('not_found', `The console has no page at ${location.pathname}.`),
        h('p', {}, h('a', { href: '/console/' }, 'Go to the start page')),
      );
    } else {
      page.dataset.page = route.name;
      document.title = `tally · ${route.name}`;
      await route.render({ ...context, principal, params: route.params });
    }
  } catch (error) {
    if (mine !== generation) return;
    if (error instanceof ApiError && error.status === 401) {
      token.clear();
      principal = null;
      render(error);
      return;
    }
    if (!page.dataset.page) page.dataset.page = route ? route.name : 'home';
    view.append(notice(error.code || 'error', error.message || String(error)));
  }
  if (mine === generation) page.dataset.ready = 'true';
}

/** Links inside the console are followed here, without a reload. */
document.addEventListener('click', (event) => {
  if (event.defaultPrevented || event.button !== 0) return;
  if (event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
  const anchor = event.target.closest('a[href]');
  if (!anchor || anchor.target || anchor.hasAttribute('download')) return;
  const url = new URL(anchor.href, location.href);
  if (url.origin !== location.origin || !url.pathname.startsWith('/console')) return;
  event.preventDefault();
  navigate(url.pathname + url.search);
});

window.addEventListener('popstate', () => render());

window.addEventListener('tally:unauthorized', (event) => {
  if (!token.get()) return;
  token.clear();
  principal = null;
  render(event.detail);
});

signoutButton.addEventListener('click', () => {
  token.clear();
  principal = null;
  render();
});

render();
