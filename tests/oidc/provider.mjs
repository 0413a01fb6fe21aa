// A real OpenID Connect provider (oidc-provider, pinned in package.json) on loopback for
// kvwatch's tests. Started by tests/oidc_provider.py as `node provider.mjs CONFIG.json`.
//
// CONFIG.json:
//   port                 the TCP port on 127.0.0.1 to listen on
//   issuer               e.g. "http://127.0.0.1:PORT" (no trailing slash)
//   clients              [{client_id, client_secret, redirect_uris, post_logout_redirect_uris?,
//                          ...any other client metadata oidc-provider accepts}]
//   users                {login: {email, name, groups: [...]}}; any other login may sign in
//                        too, as an account with email <login>@unknown.test and no groups
//   jwks                 {keys: [private JWKs]}; the first key of an algorithm signs with it;
//                        absent, a new RSA key is made for the run
//   id_token_ttl_s       lifetime of ID tokens (seconds)
//   access_token_ttl_s   lifetime of access tokens (seconds)
//
// stdout: exactly one `oidc-provider listening on <issuer>` line once it accepts requests,
// then `login <account>` for every completed sign-in (oidc-provider's own notices may
// appear as well). Warnings and errors go to stderr. SIGTERM/SIGINT: close and exit 0.

import { randomBytes } from 'node:crypto';
import { generateKeyPairSync } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';

import Provider from 'oidc-provider';

const configPath = process.argv[2];
if (!configPath) {
  console.error('usage: node provider.mjs CONFIG.json');
  process.exit(2);
}
const config = JSON.parse(readFileSync(configPath, 'utf8'));

const users = config.users ?? {};
const UNKNOWN_DOMAIN = 'unknown.test';

// The claims each account releases; the scopes granted decide which reach a token.
function accountClaims(login) {
  const known = Object.hasOwn(users, login) ? users[login] : undefined;
  if (known) {
    return {
      sub: login,
      email: known.email ?? `${login}@${UNKNOWN_DOMAIN}`,
      email_verified: true,
      name: known.name ?? login,
      groups: Array.isArray(known.groups) ? [...known.groups] : [],
    };
  }
  // A person the directory does not know: signs in, but holds no group (no role).
  return {
    sub: login,
    email: `${login}@${UNKNOWN_DOMAIN}`,
    email_verified: false,
    name: login,
    groups: [],
  };
}

async function findAccount(_ctx, id) {
  return {
    accountId: id,
    async claims() {
      return accountClaims(id);
    },
  };
}

// Every configured client is first-party: instead of a consent page, the grant for what
// the request asks (its OIDC scopes, and the claims of its `claims` parameter) is created
// or widened here.
async function loadExistingGrant(ctx) {
  const { oidc } = ctx;
  const { Grant } = oidc.provider;
  const accountId = oidc.account?.accountId ?? oidc.session.accountId;
  const clientId = oidc.client.clientId;
  const grantId = oidc.result?.consent?.grantId ?? oidc.session.grantIdFor(clientId);

  let grant = grantId ? await Grant.find(grantId) : undefined;
  if (!accountId) {
    return grant;
  }
  if (!grant || grant.accountId !== accountId || grant.clientId !== clientId) {
    grant = new Grant({ accountId, clientId });
  }
  const scopes = [...oidc.requestParamOIDCScopes];
  if (scopes.length > 0) {
    grant.addOIDCScope(scopes.join(' '));
  }
  const claims = [...oidc.requestParamClaims];
  if (claims.length > 0) {
    grant.addOIDCClaims(claims);
  }
  await grant.save();
  return grant;
}

// no keys given (the docs' example): one RSA key for this run only
function newSigningKey() {
  const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
  return { ...privateKey.export({ format: 'jwk' }), kid: `run-${Date.now()}`, use: 'sig', alg: 'RS256' };
}

const clients = (config.clients ?? []).map((client) => ({
  response_types: ['code'],
  grant_types: ['authorization_code'],
  token_endpoint_auth_method: 'client_secret_basic',
  post_logout_redirect_uris: [],
  ...client,
}));

const provider = new Provider(config.issuer, {
  clients,
  jwks: config.jwks ?? { keys: [newSigningKey()] },
  findAccount,
  loadExistingGrant,
  // email and groups go into the ID token itself, not only into /userinfo
  conformIdTokenClaims: false,
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name'],
    groups: ['groups'],
  },
  scopes: ['openid', 'offline_access', 'email', 'profile', 'groups'],
  responseTypes: ['code'],
  // PKCE: verified whenever a code_challenge is sent; required only of public clients
  // (token_endpoint_auth_method "none"), which is oidc-provider's default policy.
  pkce: { required: (_ctx, client) => client.clientAuthMethod === 'none' },
  features: {
    devInteractions: { enabled: true },
    rpInitiatedLogout: { enabled: true },
  },
  cookies: { keys: [randomBytes(32).toString('base64url')] },
  ttl: {
    AccessToken: config.access_token_ttl_s ?? 3600,
    AuthorizationCode: 600,
    Grant: 14 * 24 * 3600,
    IdToken: config.id_token_ttl_s ?? 3600,
    Interaction: 3600,
    Session: 14 * 24 * 3600,
  },
});

provider.on('interaction.ended', (ctx) => {
  const accountId = ctx.oidc?.result?.login?.accountId;
  if (accountId) {
    console.log(`login ${accountId}`);
  }
});
provider.on('server_error', (_ctx, err) => {
  console.error('oidc-provider server_error:', err);
});

const server = createServer(provider.callback());

server.on('error', (err) => {
  console.error(`oidc-provider cannot listen on 127.0.0.1:${config.port}: ${err.code ?? ''} ${err.message}`);
  process.exit(err.code === 'EADDRINUSE' ? 98 : 1);
});

server.listen(config.port, '127.0.0.1', () => {
  console.log(`oidc-provider listening on ${config.issuer}`);
});

function shutdown() {
  server.close(() => process.exit(0));
  server.closeAllConnections();
  // keep-alive sockets are closed above; never hang on anything else
  setTimeout(() => process.exit(0), 2000).unref();
}
process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);
