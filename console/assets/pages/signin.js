// Sign-in: the token is asked for here and kept in sessionStorage only. After it, the
// address the reader asked for is rendered.

import { token } from '../api.js';
import { h, notice } from '../dom.js';

export async function render({ view, refusal, signedIn }) {
  const input = h('input', {
    id: 'token',
    name: 'token',
    type: 'password',
    autocomplete: 'off',
    required: true,
    spellcheck: 'false',
  });
  const form = h(
    'form',
    { id: 'signin', class: 'signin', method: 'post' },
    h('h1', {}, 'Sign in to the tally console'),
    h('p', {}, 'Paste an API token. It is kept in this tab only, until the tab closes or you sign out.'),
    h('label', { for: 'token' }, 'API token'),
    input,
    h('button', { type: 'submit' }, 'Sign in'),
  );
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const value = input.value.trim();
    if (!value) return;
    token.set(value);
    signedIn();
  });
  if (refusal) view.append(notice(refusal.code || 'error', refusal.message));
  view.append(form);
  input.focus();
}
